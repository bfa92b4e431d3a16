"""``ray-rdt-pool stats`` without a cluster: the table built from a Prometheus export."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import pytest

from ray_rdt_pool.cli import stats_table
from ray_rdt_pool.cli.stats_table import parse_prometheus, rows_from_prometheus
from ray_rdt_pool.errors import InvalidInputError


def test_the_pool_table_skips_samples_that_are_not_finite() -> None:
    """``ray-rdt-pool stats --prometheus`` crashed (ValueError, OverflowError)
    on a NaN or +Inf sample, both valid in the Prometheus text format."""
    text = "".join(f'ray_rdt_pool_sender_used_bytes{{actor="a{i}",WorkerId="w"}} {v}\n'
                   for i, v in enumerate(("NaN", "+Inf", "-Inf", "4096")))
    rows = rows_from_prometheus(parse_prometheus(text))
    assert [(r["actor_id"], r["pool_used"]) for r in rows] == [("a3", 4096)]


def test_the_pool_table_cli_reads_an_export_and_refuses_other_text(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``ray-rdt-pool stats --prometheus URL`` against a local endpoint: the
    export's rows (an escaped quote in a label value too), and for a page that is not in
    the Prometheus text format an error naming the fix instead of an empty table."""
    pages = {
        "/metrics": "# HELP ray_rdt_pool_sender_used_bytes Bytes.\n"
                    "# TYPE ray_rdt_pool_sender_used_bytes gauge\n"
                    'ray_rdt_pool_sender_used_bytes{actor="a\\"b",WorkerId="w"} 8192.0\n'
                    'ray_rdt_pool_fallbacks_total{actor="a\\"b",WorkerId="w"} 3.0\n',
        "/": "<html><body>Ray dashboard</body></html>\n",
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages[self.path].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert stats_table.main(["--prometheus", url + "/metrics", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["actor_id"], r["pool_used"], r["fallbacks"]) for r in rows] == [
            ('a"b', 8192, 3)]
        assert stats_table.main(["--prometheus", url + "/"]) == 2
        err = capsys.readouterr().err
        assert "not in the Prometheus text format" in err and "/metrics" in err
        with pytest.raises(InvalidInputError, match="Prometheus text format"):
            stats_table.parse_prometheus(pages["/"])
    finally:
        server.shutdown()
        server.server_close()
