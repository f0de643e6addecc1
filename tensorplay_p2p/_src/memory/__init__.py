"""Tensors as MPI buffers: each tensor kind's memory, strided layouts and their datatypes, device adapters and
host buffer pools, DLPack.  ``buffers.place`` is the one decision of how a message travels."""
