"""The only package that imports Ray: the transport class and ``register()``
(transport), the process's runtime and lifecycle (runtime, stats), what Ray carries per
object (metadata), the GCS directory (directory), pack_as (conversions), objects outside
Ray's object model (owned), and every change to and read of Ray's private code
(patches)."""
