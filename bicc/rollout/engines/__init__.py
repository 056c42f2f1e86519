"""Rollout engines, one module each, found on disk: every module of this folder is imported here, so each registers
its engine in ``bicc.rollout.ENGINES``. ``hf``: HF ``generate`` on a module (the training module itself, or a copy);
``vllm``: an in-process ``vllm.LLM`` (vLLM itself is imported when one is built). A new engine is its module and its
``conf/rollout/<name>.yaml``, with no import to add here.
"""

from bicc.registry import import_folder

import_folder(__name__, __path__)
