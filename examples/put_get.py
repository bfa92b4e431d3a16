"""The smallest complete nixl_pool program: one actor puts tensors, another reads them.

Run: python examples/put_get.py
"""

import ray
import torch

import ray_rdt_pool


@ray.remote(enable_tensor_transport=True)
class Trainer:
    def __init__(self):
        ray_rdt_pool.register()  # Ray registers it here too, but asynchronously
        self.weights = [torch.randn(1024, 1024), torch.randn(1024)]

    def publish(self):
        # The pool holds a copy made now; later in-place updates are not seen.
        ref = ray.put(self.weights, _tensor_transport="nixl_pool")
        return [ref], [float(w.sum()) for w in self.weights]


@ray.remote(enable_tensor_transport=True)
class Worker:
    def __init__(self):
        ray_rdt_pool.register()

    def load(self, refs):
        tensors = ray.get(refs[0])  # one-sided NIXL READ from the trainer's pool
        return [float(t.sum()) for t in tensors]


def main() -> None:
    ray.init(runtime_env={"env_vars": {"RAY_RDT_POOL_POOL_BYTES": "64M",
                                       "RAY_RDT_POOL_ARENA_BYTES": "64M"}})
    ray_rdt_pool.register()  # in the driver, before the actors exist
    trainer, worker = Trainer.remote(), Worker.remote()
    refs, sent = ray.get(trainer.publish.remote())
    got = ray.get(worker.load.remote(refs))
    assert got == sent, (got, sent)
    print(f"received {len(got)} tensors, sums match: {got}")
    ray.shutdown()


if __name__ == "__main__":
    main()
