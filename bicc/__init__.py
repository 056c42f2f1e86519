"""BiCC: GRPO-family RL with Bilateral Context Conditioning and Reward-Confidence Correction.

One folder per concern. Imports run down this list only (tests/test_layout.py holds it):

    trainer     the run and one RL step (Algorithm 1), warm start, checkpoints, launch checks
    evaluation  pass@k on benchmarks, statistics, comparisons, plots
    rollout     engines that sample G outputs per prompt (hf, vllm) and the rollout's collection
    kernels     what makes the update fast with the same numbers (packing, prefix KV, compile)
    method      the mathematics: losses, advantages and RCC, BiCC's contexts, reference.py
    model       loading the policy, per-token log-probs
    data        tasks, datasets, rewards and answer checking
    config      typed schemas of conf/
    machine     processes, devices, host, memory model, logging
    registry    named registries (one module)
"""

LAYERS = ("registry", "machine", "config", "data", "model", "method", "kernels", "rollout", "evaluation", "trainer")
