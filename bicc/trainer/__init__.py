"""The trainer: the run (loop), one RL step as Algorithm 1 (step) and its pieces (plan, update, state, optim,
checkpoint), the SFT warm start (sft), launch checks (validation, fit) and the gradient probe. The top of
the house: it may import every folder, and none imports it."""
