"""Multi-turn loss.mode=rl on tools and environments (harness/rl/tools.py, harness/rl/episodes.py; docs/agents.md).

    python -m pytest -n 0 -q tests/test_rl_agents.py
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.rft.contract import Completion

AGENT = "configs/agent-tiny.yaml"
SMALL = ["model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 512}"]


def _rollouts(overrides=(), seed=0):
    from accelerate import Accelerator

    from harness import model as model_lib
    from harness.config import load_config
    from harness.objective import Parts
    from harness.rl.generation import SamplingSettings
    from harness.rl.prompts import rl_task
    from harness.rl.rollout import Rollouts

    cfg = load_config(AGENT, [*SMALL, *overrides])
    torch.manual_seed(seed)
    tok = model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode)
    model = model_lib.build_model(cfg.model, tok).float()
    parts = Parts(Accelerator(cpu=True), model, tok, zero_stage=0, say=lambda m: None)
    ro = Rollouts(cfg.rl, SamplingSettings.of(cfg.rft), cfg.train.grad_accum, parts, rl_task(cfg.rl, cfg.rft), 64)
    return cfg, model, tok, ro


class Scripted:
    """A stand-in for rl's Generation that answers as a trained agent would: add(2, 3), then submit(5) (right or not
    by the question), then a closing text; each turn read from how many tool results the sequence holds."""

    def __init__(self, tok, engine, wrong=False):
        self.tok, self.engine, self.wrong = tok, engine, wrong
        self.calls = []

    def answer(self, prompts, n, sampling):
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            done = self.tok.decode(p).count("<tool_response>")
            text = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                    '<tool_call>{"name": "submit", "arguments": {"answer": %d}}</tool_call>' % (6 if self.wrong else 5),
                    "Done."][min(done, 2)]
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Completion(tuple(ids))] * n)
        return out


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_tools_and_environments_are_one_line(tmp_path):
    from harness.config import load_config
    from harness.errors import ConfigError, HarnessError
    from harness.rl.tools import Toolbox
    from harness import model as model_lib

    (tmp_path / "bad_tools.py").write_text(
        "def nohints(a, b):\n    'Add.'\n    return a + b\n\n"
        "def nodoc(a: int) -> int:\n    return a\n\n"
        "class Env:\n    def reset(self, **kw):\n        return 3\n"
        "    def add(self, a: int, b: int) -> int:\n        '''Add.\n\n        Args:\n            a: a\n"
        "            b: b\n        '''\n        return a + b\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    f = tmp_path / "bad_tools.py"

    def box(*ov, template="harness/assets/chat_templates/tools.jinja"):
        cfg = load_config(AGENT, [*SMALL, f"data.chat_template={template}", *ov])
        return Toolbox(cfg.rl, model_lib.load_run_tokenizer(cfg.model, cfg.data.chat_template, cfg.loss.mode))

    with pytest.raises(ConfigError, match=r"^config key 'rl.tools\[0\]': tool 'nohints' cannot be offered .*type hint"):
        box("rl.environment=null", f"rl.tools=[{f}:nohints]")
    with pytest.raises(ConfigError, match=r"^config key 'rl.tools\[0\]': tool 'nodoc' cannot be offered"):
        box("rl.environment=null", f"rl.tools=[{f}:nodoc]")
    with pytest.raises(ConfigError, match=r"^config key 'rl.tools\[0\]': importing .*raises.py raised RuntimeError: "
                                          r"boom at import$"):
        box("rl.environment=null", f"rl.tools=[{tmp_path / 'raises.py'}:f]")
    with pytest.raises(ConfigError, match=r"^config key 'data.chat_template': the model's chat template cannot "
                                          r"render tools or a tool message"):
        box(template="gritlm")
    env = box(f"rl.environment={f}:Env")
    with pytest.raises(HarnessError, match=r"^config key 'rl.environment': Env.reset\(\) returned a int: None or "
                                           r"text .* is needed$"):
        env.start({"answer": 1})
    two = box(f"rl.environment={{calc: harness.rl.calculator:Calculator, other: {f}:Env}}")
    with pytest.raises(HarnessError, match=r"^config key 'rl.environment': a record names environment 'nope', which "
                                           r"is not one of calc, other$"):
        two.start({"environment": "nope", "answer": 1})
    assert two.start({"environment": "calc", "answer": 1})[0].__class__.__name__ == "Calculator"
    calc = box()
    got = [calc.run(calc.start({"answer": 5})[0], c) for c in
           __import__("harness.rl.tools", fromlist=["parse_calls"]).parse_calls(
               '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": '
               '{"a": 2}}</tool_call><tool_call>not json</tool_call><tool_call>{"name": "add", "arguments": '
               '{"a": 2, "b": 3}}</tool_call>')]
    assert [failed for _, failed in got] == [True, True, True, False] and got[3][0] == "5"
    assert got[0][0] == "Error: unknown tool 'nope'"


def test_tool_result_piece_is_what_the_template_renders():
    """The ids appended after a tool-calling turn are the template's text after the turn's end-of-turn token, encoded
    alone: the rendered conversation is the prompt + the sampled turn + that piece, token for token here."""
    from harness.rl.tools import Call

    cfg, model, tok, ro = _rollouts()
    box = ro.toolbox
    calls = [Call("add", {"a": 2, "b": 3})]
    piece = box.result_text(calls, ["5"])
    assert piece == "<|user|>\n<tool_response>5</tool_response>\n<|assistant|>\n"
    schemas = box.schemas["Calculator"]
    assert [s["function"]["name"] for s in schemas] == ["add", "mul", "submit"]


# ----------------------------------------------------------------------------------------------- episodes


def test_episodes_mask_tool_results_and_their_gradient_is_exactly_zero():
    """Scripted turns (add, submit, a closing text): each episode holds 3 sampled turns and 2 tool results; the mask
    is 0 exactly on the tool results' tokens; the environment's reward is the column reward/Calculator; in the
    training pass the loss's gradient at every position that predicts a tool-result token is exactly 0 (the output
    head's input there: a hook on the final norm, which feeds the head alone), and not 0 at the sampled ones."""
    from harness.rl import loss as rl_loss
    from harness.rl.batch import completion_logps, completion_mask

    cfg, model, tok, ro = _rollouts(["rft.max_new_tokens=256"])
    ro.generation = Scripted(tok, ro.engine)
    ro.generate([torch.tensor([0, 1])], step=1)
    assert ro.generation.calls == [2, 8, 8]  # turn 0: the 2 prompts x 4; turns 1-2: every live episode
    assert ro.tool_sums == [8.0, 16.0, 0.0, 24.0, 3.0]
    assert ro.rewards.names == ["Calculator"]
    item = ro.items[0]
    mask, ids = item["masks"][0], item["answers"][0]
    piece = tok("<|user|>\n<tool_response>5</tool_response>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    done = tok("<|user|>\n<tool_response>submitted</tool_response>\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    zeros = [k for k, m in enumerate(mask) if not m]
    assert [ids[k] for k in zeros][:len(piece)] == piece and len(zeros) == len(piece) + len(done)
    assert ids[zeros[0] - 1] == tok.eos_token_id  # a tool result follows the turn's sampled end-of-turn token
    item["advantages"] = [1.0, -1.0, 0.5, -0.5]  # (the scripted episodes are alike: advantage 0 otherwise)
    batch = ro.batch([item])
    assert int(batch["all_tokens"]) == sum(sum(m) for m in item["masks"])  # tool tokens not counted
    held = {}

    def keep(module, inputs, out):  # (returns None: the output unchanged)
        out.retain_grad()
        held["h"] = out

    norm = model.model.norm.register_forward_hook(keep)
    model.train()
    logps = completion_logps(model, {k: v for k, v in batch.items() if not k.startswith("packed")}, 64, 1.0)
    norm.remove()
    m = completion_mask(batch)
    per_token, _, _ = rl_loss.per_token_terms(logps, None, batch["advantages"], rl_loss.Grpo(), None, m)
    rl_loss.loss_sum("dapo", per_token, m).backward()
    grad = held["h"].grad.abs().sum(-1)  # [rows, width]: position t predicts token t + 1
    p = len(item["prompt"])
    for row in range(grad.shape[0]):
        tool_pos = [p + k - 1 for k, v in enumerate(item["masks"][row]) if not v]
        sampled = [p + k - 1 for k, v in enumerate(item["masks"][row]) if v]
        assert (grad[row, tool_pos] == 0).all()
        assert (grad[row, sampled] > 0).all()


def test_environment_reward_and_tool_figures():
    """The environment's get_reward() is the reward (1 for submit(5) on '2 + 3'-free questions only when right):
    scripted wrong answers score 0; the log line's tools/ figures."""
    cfg, model, tok, ro = _rollouts(["rft.max_new_tokens=256"])
    ro.generation = Scripted(tok, ro.engine, wrong=True)
    ro.current, _ = ro.generate([torch.tensor([0, 1])], step=1)
    assert all(r == 0.0 for it in ro.items for r in it["rewards"])
    ro.tool_unlogged = list(ro.tool_sums)
    out = ro.logged()
    assert out["tools/calls_per_episode"] == 2.0 and out["tools/failure_rate"] == 0.0
    assert out["turns"] == 3.0 and out["turns_max"] == 3.0
    assert "[tool]" in out["completions"][0]["completion"]
    # a checkpoint's generation batch keeps the masks (its rows rebuilt with the tool results ignored) and the
    # unlogged tool figures
    ro.tool_unlogged = [8.0, 16.0, 1.0, 24.0, 3.0]
    before = [b["labels"].clone() for b in ro.current]
    state = ro.state_dict()
    ro.tool_unlogged, ro.current = [0.0] * 5, []
    ro.load_state_dict(state)
    assert ro.tool_unlogged == [8.0, 16.0, 1.0, 24.0, 3.0]
    assert len(ro.current) == len(before) == 1 and torch.equal(before[0], ro.current[0]["labels"])


def test_real_engine_episodes_are_seeded_and_within_budget():
    """The continuous engine runs the episodes (a random model calls no tool: one turn each): the budget holds,
    the mask is all 1, and the same step draws the same episodes again."""
    cfg, model, tok, ro = _rollouts(["rft.max_new_tokens=12"])
    ro.generate([torch.tensor([0, 1])], step=2)
    first = [it["answers"] for it in ro.items]
    assert all(len(a) <= 12 for group in first for a in group)
    assert all(all(m) for it in ro.items for m in it["masks"])
    ro.generate([torch.tensor([0, 1])], step=2)
    assert [it["answers"] for it in ro.items] == first


# ----------------------------------------------------------------------------------------------- end to end


def test_agent_tiny_runs_grpo_steps_on_the_calculator(tmp_path):
    """`harness train configs/agent-tiny.yaml` (a smaller random model, 2 steps): the episodes run through the
    continuous engine, the environment's reward and the tool figures are in the log line."""
    from tests.harness_launch import metrics, run_train

    out = tmp_path / "run"
    run_train([*SMALL, f"train.output_dir={out}", "train.max_steps=2", "rl.num_generations=2",
               "rft.max_new_tokens=24", "rl.log_completions=1"], config=AGENT, timeout=300)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/Calculator", "tools/calls_per_episode", "tools/failure_rate", "turns", "turns_max"):
        assert key in rows[-1], key
    assert rows[-1]["turns"] >= 1 and rows[-1]["completions"][0]["prompt"].count("<tool_call>") == 1


# ----------------------------------------------------------------------------------------------- TRL parity

from tests.test_rl import COMPLETION, N, PROMPT, _close, _grads, fixed, trl_loss  # noqa: E402,F401 (fixture)


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_tool_masked_loss_and_gradients_equal_trl(fixed, loss_type, beta):
    """Fixed multi-turn rollouts (completions with tool-result spans: env_mask 0 inside them) through TRL 1.16's
    _compute_loss with `tool_mask` (what its rollout_func's env_mask becomes) and through harness's rows with the
    tool results' labels ignored (`mask_tool_results`, Rollouts.batch's path): the same loss and every gradient
    within 1e-5 (test_rl.py's tolerance: fp32 sums in two orders), each of the 4 loss types."""
    import copy

    from harness.rl import loss as rl_loss
    from harness.rl.batch import completion_logps, completion_mask, rows
    from harness.rl.episodes import mask_tool_results

    tok, model, path, prompts, completions, cmask, rewards, old, ref = fixed
    lengths = cmask.sum(1).tolist()  # [7, 3, 5, 1, 6, 4]
    env = torch.ones_like(cmask)
    for row, (a, b) in {0: (2, 5), 2: (1, 3), 4: (3, 4), 5: (1, 2)}.items():  # tool spans inside the completions
        env[row, a:b] = 0
    temperature = 0.7
    adv, _ = rl_loss.advantages(rewards, 3, "group")
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": cmask, "advantages": adv, "old_per_token_logps": old, "tool_mask": env,
              "num_items_in_batch": (cmask * env).sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    ref_loss, ref_grads = trl_loss(path, tok, model, loss_type, beta, inputs, temperature)

    ours = copy.deepcopy(model).train()
    batch = rows([p.tolist() for p in prompts], [c[:n].tolist() for c, n in zip(completions, lengths)],
                 tok.pad_token_id)
    mask_tool_results(batch["labels"], [PROMPT] * N, [env[r, :n].tolist() for r, n in enumerate(lengths)])

    def place(t):
        out = torch.zeros(N, batch["input_ids"].shape[1] - 1)
        out[:, PROMPT - 1:PROMPT - 1 + COMPLETION] = t
        return out

    mask = completion_mask(batch)
    assert torch.equal(place((cmask * env).float()), mask.float())  # harness's mask is TRL's completion x tool mask
    logps = completion_logps(ours, batch, chunk_size=5, temperature=temperature)
    grpo = rl_loss.Grpo(loss_type, 0.2, 0.28, beta, "token", max_new_tokens=COMPLETION)
    loss = rl_loss.grpo_loss(logps, place(old), adv, mask, grpo, place(ref) if beta else None)
    loss.backward()
    _close(loss.detach(), ref_loss)
    grads = _grads(ours)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _close(grads[name], ref_grads[name])
