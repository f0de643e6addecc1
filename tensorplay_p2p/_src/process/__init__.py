"""This process in its job: MPI start-up and the default group's life cycle (``runtime``), process groups, the
job-wide timeout (``watchdog``), Ctrl-C and SIGTERM in a wait (``signals``), ranks that leave (``departures``),
ending the job (``abort``), and the rendezvous the framework integrations share."""
