"""Online RL with verifiable rewards (loss.mode=rl, rl.algorithm=grpo; docs/rl.md): sample a group of answers per
question from the model being trained, score them with the task's verifier, step on the group-normalised advantages.

    loss.py     GRPO's clipped policy loss, KL, reductions and advantages: pure tensor code (TRL 1.16's definitions)
    batch.py    completions as training rows; their per-token log-probs through the output head in chunks
    rollout.py  each generation batch: the questions in a seeded order, sampling with the continuous engine from
                the current weights (ZeRO-3's gathered), rewards, advantages, old and reference log-probs
    step.py     the micro-step the objective runs, the log line's figures, the evaluation (rft test accuracy)
"""
