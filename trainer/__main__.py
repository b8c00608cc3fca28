"""`python -m packtrain.trainer -c CONFIG …`: the trainer's own entry, what torchrun starts in the pods."""

import sys

from packtrain.trainer.cli import main

sys.exit(main())
