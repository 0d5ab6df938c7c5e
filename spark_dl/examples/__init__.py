"""Ready-made training functions for HorovodRunner, used by the scripts in ``runners/``."""
