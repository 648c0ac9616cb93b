"""Plain engine cores, no Ray: the outer optimizer's merge state machine, checkpoints, token accounting, the event log, evaluation."""
