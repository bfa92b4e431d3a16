"""The only package that imports Ray: the transport class, the runtime, the metadata,
the directory, and the patches of Ray's internals."""
