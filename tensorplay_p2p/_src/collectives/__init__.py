"""The collectives: the calls (``api``, and the block-moving ones in ``blocks``), their handle (``work``), their
arguments as host bytes (``arguments``), reductions, the checks that keep a group's members in step (``checks``),
and the object collectives (``objects``)."""
