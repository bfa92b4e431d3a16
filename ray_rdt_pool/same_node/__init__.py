"""Same-node sharing: a sender's pool in shared memory, read by receivers on its node.

One module per lifetime:

* ``memfd``: the sender's pool in a ``memfd`` (:class:`SharedHostMemory`);
* ``leases``: the sender's lease table, which receiver holds which page;
* ``info``: the directory entry a sender publishes, and how a process is named;
* ``pool_handle``: a receiver's handle on one sender's pool and its private mapping;
* ``privatize``: what a forked child of a receiver does with the mappings it inherited;
* ``cuda``: a CUDA pool's IPC export and a receiver's opening of it;
* ``peer_memory``: copies straight out of a sender process (the weights stream);
* ``_libc``: the ctypes bindings they share.
"""
