"""TransferQueue's batch layout for the ``transferqueue`` variant of the benchmark.

:func:`tq_batch` turns a workload's tensors into the TensorDict that ``kv_batch_put``
takes, :func:`tq_unbatch` turns what ``kv_batch_get`` returns back into tensors.
"""

from __future__ import annotations

from typing import Any

from ray_rdt_pool.bench import workloads as W


def tq_batch(spec: W.WorkloadSpec, tensors: list[Any]) -> Any:
    """The experience batch as the one TensorDict (batch size N) TransferQueue stores.

    Batched layout: the field tensors as they are. Per-sample layout: each field's
    per-sample tensors stacked (a copy; part of the put, since kv_batch_put takes a
    batch and this is what a caller holding per-sample tensors has to do).
    """
    import torch
    from tensordict import TensorDict

    fields = [name for name, _dt, _seq in W.EXPERIENCE_FIELDS]
    n = spec.sizes.exp_samples
    if spec.name == "experience":
        data = dict(zip(fields, tensors))
    else:
        k = len(fields)
        data = {f: torch.stack(tensors[j::k]) for j, f in enumerate(fields)}
    return TensorDict(data, batch_size=[n])


def tq_unbatch(spec: W.WorkloadSpec, batch: Any) -> list[Any]:
    """The tensors of a TensorDict from ``kv_batch_get`` in the workload's layout order.

    TransferQueue stores samples one by one and returns a field of per-sample vectors as
    a jagged nested tensor (scalars as a dense ``[N]`` tensor); this rebuilds the sent
    list so its checksum can be compared with the sender's. It runs after the timed
    get (like the checksum): how a consumer uses the batch is not the transport's cost.
    """
    import torch

    n = spec.sizes.exp_samples
    per_field: list[list[Any]] = []
    for name, _dt, _seq in W.EXPERIENCE_FIELDS:
        value = batch[name]
        rows = list(value.unbind()) if value.is_nested else list(value.unbind(0))
        if len(rows) != n:
            raise ValueError(f"transferqueue returned {len(rows)} samples of {name}, "
                             f"expected {n}")
        per_field.append(rows)
    if spec.name == "experience":
        return [torch.stack(rows) for rows in per_field]
    return [per_field[j][i] for i in range(n) for j in range(len(per_field))]
