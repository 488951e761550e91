"""Host memory and bytes over the link: pinned buffers, the layout of arenas and buckets, the
slot ring and side streams, the bucket pipeline and the CPU worker. Imports nothing above it."""
