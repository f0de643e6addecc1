"""Persistent exchanges over tensors in place: the persistent requests (``exchange``), ``P2PPlan`` (``plan``),
``HaloExchange`` (``halo``) and Cartesian groups (``cart``)."""
