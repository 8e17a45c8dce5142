"""A team's own competition script as a trainer: its constants (``source``, torch-free), its output
(``output``) and the process that runs it and speaks the trainer's JSON lines (``run``)."""
