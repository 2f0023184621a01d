import sys

from mhar_lit.eval.lm_eval_adapter import lm_eval_main

sys.exit(lm_eval_main())
