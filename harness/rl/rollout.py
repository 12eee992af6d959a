"""Each generation batch of loss.mode=rl: questions, answers sampled from the current weights, rewards, advantages.

Every rl.iterations optimizer steps, each process takes its next grad_accum micro-batches of question indices from
its prepared loader (rl.questions_per_step over all processes; a seeded order that resume restores as any data
position), samples rl.num_generations answers to each with the continuous engine (rft.temperature, rft.top_p,
rft.max_new_tokens; under ZeRO-3 the weights gathered for the generation as TRL does), scores them with the reward
(`rl.reward`: the task's verifier, 1 verified and 0 otherwise, or a function `module:name` called as
fn(question, answer_text) -> float), and turns them into training rows with their group-normalised advantages. The
generation is seeded from rft.seed, the generation's step and the question, so that the same weights give the same
answers again (one engine call per question, seeded by the step and the question: the same answers on any
process count). With rl.iterations > 1 the old log-probs are computed once here (no gradient) and kept for the ratio
of the later updates; with beta > 0 the reference (the model as it started: a frozen copy, partitioned under
ZeRO-3; with LoRA the model with its adapters off) scores every batch.

    python -c "from harness.rl.rollout import Rollouts; help(Rollouts)"
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter

import torch

from harness.data import IGNORE_INDEX
from harness.distributed.collectives import agreed
from harness.distributed.zero import partitioned_copy
from harness.errors import ConfigError
from harness.rft.contract import GREEDY, texts as answer_texts
from harness.rft.tasks import Task
from harness.rl.episodes import (env_reward, marked_text, mask_tool_results, records, run_episodes,
                                 sampled_count, tool_figures, tool_sums)
from harness.rl.generation import Generation, Prompts, SamplingSettings, served  # noqa: F401 (served: here before)
from harness.rl import loss as rl_loss
from harness.rl.batch import (completion_logps, completion_mask, padding_free, rows, scored_positions,
                              shared_prompts)
from harness.rl.tools import Toolbox
from harness.rl.prompts import Rewards, function_figures, function_sums, load_reward, rl_task, score  # noqa: F401 (load_reward, score: here before)
from harness.state import StepSums


def index_batch(indices: list) -> torch.Tensor:
    """The question loader's collate: a micro-batch of question indices."""
    return torch.tensor(indices, dtype=torch.long)


def question_loader(rl, rft, grad_accum: int, shuffle: bool, world: int, cache_dir=None):
    """(the task, a DataLoader of train question indices: rl.questions_per_step / (processes x grad_accum) a
    micro-batch) of loss.mode=rl; not prepared. `rl`, `rft`: cfg.rl, cfg.rft; grad_accum: train.grad_accum;
    shuffle: data.shuffle; cache_dir: data.cache_dir (rl.prompts from parquet or the hub)."""
    from torch.utils.data import DataLoader

    task = rl_task(rl, rft, cache_dir)
    questions = task.split("train")
    per = rl.questions_per_step / (world * grad_accum)
    if per != int(per):
        raise ConfigError(f"config key 'rl.questions_per_step': {rl.questions_per_step} questions do not divide "
                          f"into {world} process(es) x train.grad_accum {grad_accum} micro-batches")
    if len(questions) < rl.questions_per_step:
        raise ConfigError(f"config key 'rl.questions_per_step': {rl.questions_per_step} is more than the task's "
                          f"{len(questions)} train questions")
    return task, DataLoader(list(range(len(questions))), batch_size=int(per), shuffle=shuffle,
                            collate_fn=index_batch)




def share(state: dict, world: int, rank: int, accum: int, questions: int) -> tuple[list, str]:
    """(process `rank`'s items of a saved generation batch in a layout of `world` processes x `accum` micro-batches,
    why there are none where the batch cannot continue). A saving process r's k-th micro-batch of `per` questions
    was the batch's (k x processes + r)-th (accelerate deals a loader's batches to the processes in turn): the
    items are put back in the batch's order, and each process takes the micro-batches it would have drawn in the
    new layout (rank r: the (k x world + r)-th ones), as an uninterrupted run of that layout holds them. A
    checkpoint without `per` (an older harness, which refused another process count) is split as it was saved."""
    parts, saved_world, per = state["items"], state.get("world", len(state["items"])), state.get("per")
    ordered = [it for k in range(len(parts[0]) // per) for r in range(saved_world)
               for it in parts[r][k * per:(k + 1) * per]] if per else [it for part in parts for it in part]
    if not ordered:
        return [], ""
    if len(ordered) != questions:
        return [], (f"the checkpoint's generation batch has {len(ordered)} questions, rl.questions_per_step is "
                    f"{questions}")
    if not per:  # each process its part, as saved (the same process count)
        return ordered[rank * questions // world:(rank + 1) * questions // world], ""
    n = questions // (world * accum)
    return [it for k in range(accum) for it in ordered[(k * world + rank) * n:(k * world + rank + 1) * n]], ""


def unfit(state: dict, rl) -> str:
    """Why a saved generation batch cannot continue under this config's `rl` (cfg.rl) settings ("" when it can): its
    answers a question are not rl.num_generations, or it lacks the log-probs rl.beta > 0 (reference) or
    rl.iterations > 1 (old) needs (settings changed on resume: checkpoint/settings.py records them)."""
    items = [it for part in state["items"] for it in part]
    if not items:
        return ""
    if len(items[0]["answers"]) != rl.num_generations:
        return f"rl.num_generations changed since: it has {len(items[0]['answers'])} answers a question"
    if rl.beta and "ref_logps" not in items[0]:
        return "rl.beta changed since: it has no reference log-probs"
    if rl.iterations > 1 and "old_logps" not in items[0]:
        return "rl.iterations changed since: it has no old log-probs"
    return ""


def reference_model(beta: float, peft: bool, parts):
    """The reference of rl.beta > 0 (None at 0): with peft, TRL's way, the same model with its adapters disabled;
    under ZeRO-3 the model as it starts, partitioned as the trained one is; else a frozen copy of it."""
    unwrapped = parts.accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    if not beta:
        return None
    if peft:
        return unwrapped
    if parts.zero_stage == 3:
        return partitioned_copy(parts.accelerator, parts.model, parts.convert)
    return copy.deepcopy(unwrapped).eval().requires_grad_(False)


class Rollouts:
    """The generation batches of a run (see the module docstring): `step_batches(questions, step)` gives the step's
    grad_accum training micro-batches; `evaluate()` the greedy accuracy on the task's test split."""

    def __init__(self, rl, sampling: SamplingSettings, grad_accum: int, parts, task: Task, chunk_size: int) -> None:
        """`rl`: cfg.rl; sampling: the rft section's sampling settings; grad_accum: train.grad_accum; parts: the
        build's harness.objective.Parts (accelerator, prepared model, tokenizer, ZeRO stage, say, and `convert`: what
        the build did to the model after building it, train.precision=fp8's float8 blocks, done to ZeRO-3's reference
        copy too); task: the questions (built once, with the question stream)."""
        accelerator, model, tokenizer, say = parts.accelerator, parts.model, parts.tokenizer, parts.say
        self.rl, self.r, self.accum = rl, sampling, grad_accum
        self.accelerator, self.model, self.tok, self.task = accelerator, model, tokenizer, task
        self.chunk_size, self.zero_stage, self.say = chunk_size, parts.zero_stage, say
        self.prompts = Prompts(task, tokenizer, say)  # each prompt encoded once
        self.questions, self.test = self.prompts.train, self.prompts.test
        # rl.rewards, or rl.reward as one function (failing to load on any process: one line)
        # rl.tools / rl.environment: multi-turn episodes (harness/rl/episodes.py), the environment's reward beside
        self.toolbox = agreed(accelerator, lambda: Toolbox(rl, tokenizer)) if rl.tools or rl.environment else None
        self.rewards = agreed(accelerator, lambda: Rewards(rl, task, self.toolbox and self.toolbox.reward_name))
        config = accelerator.unwrap_model(model, keep_torch_compile=False).config
        answers = rl.questions_per_step // accelerator.num_processes * rl.num_generations  # this process's a batch
        self.generation = Generation(sampling, answers, parts)  # (a model it cannot serve: one line)
        self.engine, self.peft = self.generation.engine, self.generation.peft
        self.prompts.check_context(config, sampling.max_new_tokens)  # every prompt and its answer, before step 1
        # the training pass's rows (rl.rows): a prompt shared by its answers needs a custom 4D mask, which only
        # sdpa attention reads as given here (eager adds it, flash and flex take no dense mask)
        self.layout = rl.rows
        if rl.rows == "shared_prompts" and getattr(config, "_attn_implementation", None) != "sdpa":
            self.layout = "packed"
            say(f"[harness] rl: rl.rows=shared_prompts needs sdpa attention (this model runs "
                f"{getattr(config, '_attn_implementation', None)}): the answers are packed, one prompt each")
        self.reference = reference_model(rl.beta, self.peft, parts)
        self.current: list = []  # the generation batch's micro-batches (on the device)
        self.figures = StepSums()  # its rewards and lengths, logged with every step trained on it
        self.items: list = []  # the same as questions: prompt, answers, rewards, advantages, old / reference log-probs
        self.dropped = ""  # why a checkpoint's half-used generation batch could not continue (`share`)
        self.gen_calls = 0  # engine calls of generation batches (this process), logged as gen_calls
        self.fn_sums: list = []  # each reward function's [sum, squares, count] of the current batch (this process)
        self.fn_unlogged = [0.0] * (3 * len(self.rewards.names))  # ... of the steps since the last log line
        self.tool_sums, self.tool_unlogged = [0.0] * 5, [0.0] * 5  # episodes' tool figures (episodes.tool_sums)

    def step_batches(self, questions, step: int, unlogged) -> list[dict]:
        """The micro-batches of optimizer step `step`: a new generation batch every rl.iterations steps (the next
        grad_accum question micro-batches of `questions`), else the current one again."""
        if (step - 1) % self.rl.iterations == 0 or not self.current:
            if (step - 1) % self.rl.iterations:
                self.say(f"[harness] rl: no generation batch to continue at step {step} "
                         f"({self.dropped or 'a checkpoint without one'}): a new one starts here")
            picked = [next(questions) for _ in range(self.accum)]
            t0 = time.perf_counter()
            self.current, self.figures = self.generate(picked, step)
            gen_s = time.perf_counter() - t0
            main = self.accelerator.is_main_process
            unlogged.add(StepSums(rl_gen_s=gen_s if main else 0.0, rl_gen_calls=self.gen_calls if main else 0))
            self.gen_calls = 0
        unlogged.add(self.figures)  # each step logs the rewards and lengths of the answers it trains on
        self.fn_unlogged = [a + b for a, b in zip(self.fn_unlogged, self.fn_sums)]
        self.tool_unlogged = [*(a + b for a, b in zip(self.tool_unlogged[:4], self.tool_sums[:4])),
                              max(self.tool_unlogged[4], self.tool_sums[4])]
        return self.current

    @torch.no_grad()
    def generate(self, picked: list, step: int) -> tuple[list[dict], StepSums]:
        """(the micro-batches of this process's answers to the `picked` questions, their sums for the log)."""
        G = self.rl.num_generations
        qs = [[self.questions[int(i)] for i in b] for b in picked]
        flat = [q for b in qs for q in b]
        prompts = self.prompts.ids(flat)  # encoded once: the engine's and the rows' ids
        index = [int(i) for b in picked for i in b]
        if self.toolbox is not None:  # multi-turn episodes: the environment's reward and the tool-result masks
            return self.finish(picked, flat, *self.episodes(flat, index, step))
        # one engine call for every question of the batch; answer j of question `index[i]` seeded by (rft.seed,
        # step, the question, j) alone: the same tokens whatever shares the call and on any process count
        got = self.generation.answer(prompts, G, self.r.call(lambda i, j: (self.r.seed, step, index[i], j)))
        sampled = [[list(c.ids) for c in group] for group in got]  # the tokens drawn (EOS kept): what the loss scores
        texts = answer_texts(self.tok, got, self.engine.eos)
        return self.finish(picked, flat, prompts, sampled, texts)

    def episodes(self, flat: list, index: list[int], step: int) -> tuple:
        """(prompts, sampled, texts, masks, the environment's rewards) of the batch's multi-turn episodes."""
        G = self.rl.num_generations
        prompts, eps = run_episodes(self.generation, self.toolbox, records(self.task, flat), index, self.rl, self.r,
                                    step)
        self.tool_sums = tool_sums(eps)
        grouped = [eps[k * G:(k + 1) * G] for k in range(len(flat))]
        texts = [[self.tok.decode([t for t in e.ids if t not in self.engine.eos], skip_special_tokens=True).strip()
                  for e in group] for group in grouped]
        env = [env_reward(e) for e in eps] if self.toolbox.reward_name else None
        return prompts, [[e.ids for e in g] for g in grouped], texts, [[e.mask for e in g] for g in grouped], env

    def finish(self, picked: list, flat: list, prompts: list, sampled: list, texts: list, masks=None,
               env=None) -> tuple[list[dict], StepSums]:
        """The batch's rewards, advantages, items, micro-batches and old / reference log-probs."""
        accelerator, G, dev = self.accelerator, self.rl.num_generations, self.accelerator.device
        # (a reward that fails on any process: its line raised on every process, printed once by the main one)
        weighted, per = agreed(accelerator, lambda: self.rewards.score(
            [q for q in flat for _ in range(G)], [t for a in texts for t in a], [ids for a in sampled for ids in a],
            env))
        rewards = weighted.to(torch.float32).to(dev)
        self.gen_calls += 1
        every = accelerator.gather(rewards) if self.rl.scale_rewards == "batch" else None  # TRL's batch: all
        adv, _ = rl_loss.advantages(rewards, G, self.rl.scale_rewards,  # processes' answers
                                    None if every is None else rl_loss.nanstd(every))
        rewards = torch.nan_to_num(rewards, nan=0.0)  # (logged: an answer no function scored counts 0)
        items, at = [], 0
        for k, (p, answers) in enumerate(zip(prompts, sampled)):
            items.append({"prompt": p, "answers": answers, "rewards": rewards[at:at + G].tolist(),
                          "advantages": adv[at:at + G].tolist(), "functions": per[at:at + G].tolist(),
                          **({"masks": masks[k]} if masks else {})})
            at += G
        per = len(picked[0])
        out = [self.batch(items[k:k + per]) for k in range(0, len(items), per)]
        for k, batch in enumerate(out):  # the old (rl.iterations > 1) and reference log-probs, kept with the items
            for name, model in (("old_logps", self.model if self.rl.iterations > 1 else None),
                                ("ref_logps", self.reference)):
                if model is not None:
                    with model.disable_adapter() if name == "ref_logps" and self.peft else contextlib.nullcontext():
                        batch[name] = completion_logps(model, batch, self.chunk_size, self.r.temperature)
                    on = completion_mask(batch).bool()
                    mine = items[k * per:(k + 1) * per]
                    for item in mine:
                        item[name] = [None] * G  # (an answer left out of the pass has none: `trained`)
                    for row, (j, g) in enumerate(self.trained(mine)):
                        mine[j][name][g] = batch[name][row][on[row]].cpu()
        self.items = items
        self.scale(out)
        return out, self.figures_of(items)

    def trained(self, items: list[dict]) -> list[tuple[int, int]]:
        """The (item, answer) pairs of a micro-batch that its training pass runs, in row order. With rl.beta 0 an
        answer of advantage exactly 0 (every answer of a question whose rewards are all equal, an answer no function
        scored) adds exactly nothing to the loss or its gradient: -min(r x 0, clip(r) x 0) whatever its log-probs;
        it is left out of the pass (its tokens still count in the step's denominator and the log). Two are kept when
        none is left, so that every process runs its pass (DDP's and DeepSpeed's collectives) of more than one row
        (rl.rows padded: one row would make torch.compile compile the blocks again; the packed forms add a row,
        `two_rows`). With rl.beta > 0 every answer (the KL term has a gradient)."""
        pairs = [(j, g) for j, it in enumerate(items) for g in range(len(it["answers"]))]
        if self.rl.beta:
            return pairs
        return [(j, g) for j, g in pairs if items[j]["advantages"][g] != 0.0] or pairs[:2]

    def batch(self, items: list[dict]) -> dict:
        """A micro-batch of questions' answers (a row each: `trained`), with the log-probs the items carry;
        `all_answers` and `all_tokens` count every answer of the items and its tokens, those left out too (the
        step's denominator)."""
        dev = self.accelerator.device
        pairs = self.trained(items)
        answers = [items[j]["answers"][g] for j, g in pairs]
        batch = rows([items[j]["prompt"] for j, _ in pairs], answers, self.tok.pad_token_id)
        batch["advantages"] = torch.tensor([items[j]["advantages"][g] for j, g in pairs], dtype=torch.float32)
        if "masks" in items[0]:  # tool results: no loss, not counted (rl.tools / rl.environment)
            mask_tool_results(batch["labels"], [len(items[j]["prompt"]) for j, _ in pairs],
                              [items[j]["masks"][g] for j, g in pairs])
        if self.rl.mask_truncated_completions:  # answers cut at rft.max_new_tokens: no loss (TRL's masking)
            batch["labels"][torch.tensor([self.cut(a) for a in answers])] = IGNORE_INDEX
        every = [(a, (it.get("masks") or [None] * len(it["answers"]))[g]) for it in items
                 for g, a in enumerate(it["answers"])]
        tokens = sum(0 if self.rl.mask_truncated_completions and self.cut(a) else sampled_count(a, m) for a, m in every)
        batch["all_answers"], batch["all_tokens"] = torch.tensor(len(every)), torch.tensor(tokens)
        batch["scored"] = scored_positions(batch["labels"])  # on the host: the head's positions, no device sync
        if self.layout == "shared_prompts":
            kept = Counter(j for j, _ in pairs)  # answers kept per question, in row order (questions with none: out)
            batch.update(shared_prompts(batch, [len(items[j]["prompt"]) for j in kept], list(kept.values()),
                                        self.tok.pad_token_id))
        elif self.layout == "packed":
            batch.update(padding_free(batch, self.tok.pad_token_id))
        batch = {k: v.to(dev) for k, v in batch.items()}
        on = completion_mask(batch).bool()
        for name in ("old_logps", "ref_logps"):
            if name in items[0]:
                t = torch.zeros(on.shape, dtype=torch.float32, device=dev)
                t[on] = torch.cat([items[j][name][g].to(dev) for j, g in pairs])
                batch[name] = t
        return batch

    def cut(self, answer: list[int]) -> bool:
        """An answer cut at rft.max_new_tokens (no EOS): rl.mask_truncated_completions leaves it out of the loss."""
        return len(answer) >= self.r.max_new_tokens and answer[-1] != self.tok.eos_token_id

    def figures_of(self, items: list[dict]) -> StepSums:
        """The batch's sums for the log line (and each reward function's, `fn_sums`)."""
        if self.rewards.names:
            self.fn_sums = function_sums(torch.tensor([f for it in items for f in it.get("functions", [])],
                                                      dtype=torch.float64).view(-1, len(self.rewards.names)))
        r = torch.tensor([it["rewards"] for it in items], dtype=torch.float64)
        flat = torch.isclose(r.std(1), torch.zeros(len(items), dtype=torch.float64))
        return StepSums(rl_reward_sum=float(r.sum()), rl_reward_sq_sum=float((r ** 2).sum()), rl_answers=r.numel(),
                        rl_flat_groups=int(flat.sum()), rl_groups=len(items),
                        rl_length_sum=sum(len(a) for it in items for a in it["answers"]))

    def logged(self) -> dict:
        """What a log line adds (collective): reward/<name> and reward/<name>_std of each rl.rewards function over
        the steps since the last log line, all processes; `completions`: rl.log_completions rows (prompt,
        completion, reward) of the main process's current batch."""
        out = {}
        if self.rewards.names:
            sums = self.accelerator.reduce(torch.tensor(self.fn_unlogged, dtype=torch.float64,
                                                        device=self.accelerator.device), "sum").tolist()
            self.fn_unlogged = [0.0] * len(self.fn_unlogged)
            out.update(function_figures(self.rewards.names, sums))
        if self.toolbox is not None:  # the episodes' tool calls and turns, all processes
            every = self.accelerator.gather(torch.tensor([self.tool_unlogged], dtype=torch.float64,
                                                         device=self.accelerator.device)).cpu()
            out.update(tool_figures([*every[:, :4].sum(0).tolist(), float(every[:, 4].max())]))
            self.tool_unlogged = [0.0] * 5
        n = self.rl.log_completions
        if n and self.accelerator.is_main_process and self.items:
            pairs = [(it, k) for it in self.items for k in range(len(it["answers"]))][:n]
            out["completions"] = [{"prompt": self.tok.decode(it["prompt"]),
                                   "completion": marked_text(self.tok, it["answers"][k], (it.get("masks") or
                                                                                         [None] * (k + 1))[k]),
                                   "reward": it["rewards"][k], "advantage": it["advantages"][k]} for it, k in pairs]
        return out

    # ---- saved with each checkpoint (accelerate's register_for_checkpointing): the half-used generation batch
    def state_dict(self) -> dict:
        """Every process's items of the current generation batch, in process order, and the questions a micro-batch
        (`per`) that place them in the batch's question order (collective)."""
        from accelerate.utils import gather_object

        world = self.accelerator.num_processes
        fn = [sum(v) for v in zip(*gather_object([self.fn_unlogged]))] if world > 1 else self.fn_unlogged
        tools = [*(sum(v) for v in zip(*gather_object([self.tool_unlogged[:4]]))),  # (the max apart)
                 max(gather_object([self.tool_unlogged[4]]))] if world > 1 else self.tool_unlogged
        return {"items": gather_object([self.items]) if world > 1 else [self.items], "world": world,
                "per": len(self.items) // self.accum, "fn_unlogged": fn, "tool_unlogged": tools}

    def load_state_dict(self, state: dict) -> None:
        """This process's share of the saved generation batch (`share`: in this run's layout, which may have
        another process count and accumulation), in grad_accum micro-batches again."""
        world, accum = self.accelerator.num_processes, self.accum
        fn = state.get("fn_unlogged") or []
        if len(fn) == len(self.fn_unlogged) and self.accelerator.is_main_process:  # the unlogged reward figures
            self.fn_unlogged = list(fn)
            self.tool_unlogged = list(state.get("tool_unlogged") or self.tool_unlogged)
        mine, self.dropped = share(state, world, self.accelerator.process_index, accum, self.rl.questions_per_step)
        self.dropped = self.dropped or unfit(state, self.rl)
        if not mine or self.dropped:
            return
        per = len(mine) // accum
        self.items = mine
        self.current = [self.batch(mine[k:k + per]) for k in range(0, len(mine), per)]
        self.scale(self.current)
        self.figures = self.figures_of(mine)

    def scale(self, batches: list[dict]) -> None:
        """Each micro-batch's factor W x A / the step's denominator (rl.loss_type; one all-reduce of the counts)."""
        local = torch.tensor([sum(int(b["all_answers"]) for b in batches), sum(int(b["all_tokens"]) for b in batches)],
                             dtype=torch.float64, device=self.accelerator.device)
        completions, tokens = self.accelerator.reduce(local, "sum").tolist()
        total = rl_loss.denominator(self.rl.loss_type, completions, tokens, self.r.max_new_tokens)
        factor = torch.tensor(rl_loss.step_factor(self.accelerator.num_processes, self.accum, total),
                              dtype=torch.float32, device=self.accelerator.device)
        for b in batches:
            b["scale"] = factor

    @torch.no_grad()
    def evaluate(self) -> dict:
        """eval_accuracy and eval_answer_rate: greedy answers to the task's test split, every world-th question on
        each process, counted over all."""
        accelerator = self.accelerator
        if not self.test:  # no rft.test_file, or rl.prompts: no test split to answer
            return {}
        mine = self.test[accelerator.process_index::accelerator.num_processes]
        got = self.generation.answer(self.prompts.ids(mine), 1, GREEDY)  # (every process: ZeRO-3 gathers)
        texts = answer_texts(self.tok, got, self.engine.eos)
        right = sum(self.task.verify(t[0], q) for q, t in zip(mine, texts))
        answered = sum(self.task.extract(t[0]) is not None for t in texts)
        totals = accelerator.reduce(torch.tensor([right, answered, len(mine)], dtype=torch.float64,
                                                 device=accelerator.device), "sum").tolist()
        return {"eval_accuracy": totals[0] / max(totals[2], 1), "eval_answer_rate": totals[1] / max(totals[2], 1)}
