"""The trainer: the run (loop) and what it prints at start (banner), one RL step as Algorithm 1 (step) and its pieces
(plan, update, state, optim, checkpoint), the SFT warm start (sft), launch checks (validation, fit), the gradient probe
(probe) and the viewer of logged samples (samples). The top of the house: it may import every folder, and none imports
it."""
