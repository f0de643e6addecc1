"""Point-to-point: the calls (``ops``), their handles (``work``), group, peer and tag checks (``validate``),
checked mode's message header (``checked``), and torch profiler events around every op (``profiling``)."""
