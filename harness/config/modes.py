"""The loss modes' facts: what the rest of the house asks of a mode by its name, answered in one table.

Each mode is a component (harness/modes/: its object, built once by the registry, is what the loop and train_step
call). What the parts below the run need to know of a mode before that object exists (which data streams it reads,
which config sections, what a generative row is, whether the model embeds) is a `ModeFacts` row here, read through
`facts(name)`: no module outside config/ and harness/modes/ compares the mode's name with a string. A new mode
registers its row (harness.modes.register does both), so that `loss.mode` accepts it and every part reads its facts.
Light: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ConfigError


@dataclass(frozen=True)
class ModeFacts:
    name: str
    gen_rows: str | None = None  # what a generative stream row is: "sequences" (data.train_files), "pairs"
    #                              (chosen + rejected), "questions" (prompt indices the mode answers itself), or None
    embeds: bool = False  # reads embedding data (data.emb_train_files) and embeds with the model
    combined: bool = False  # two weighted losses, generative + embedding (GritLM's unified loss)
    sections: tuple = ()  # config sections the run reads beyond the common ones (saved in its config.yaml)
    packs_causal: bool = False  # data.packing packs causal documents (a packed row's per-document attention)
    chunked_head: str = "auto"  # the output head: "auto" (loss.chunked_ce decides) or "always" in chunks
    streams: bool = False  # data.streaming can feed its generative rows
    tags: tuple = ("text-generation",)  # the model card's tags
    tag_key: str | None = None  # a loss.<key> whose value is one more tag (preference: its loss, e.g. dpo)
    pipeline: str = "text-generation"  # the model card's pipeline tag
    vision: bool = False  # a vision-language model trains in this mode (image records: harness.data.vision)
    profile_packs: bool = True  # a speed profile's data.packing applies (not to modes that score one sequence a row)

    @property
    def reads_data(self) -> bool:
        """Reads data.train_files (generative sequences or pairs)."""
        return self.gen_rows in ("sequences", "pairs")


MODES: dict[str, ModeFacts] = {f.name: f for f in (
    ModeFacts("generative", gen_rows="sequences", packs_causal=True, streams=True, vision=True),
    ModeFacts("embedding", embeds=True, tags=("sentence-similarity", "feature-extraction"),
              pipeline="feature-extraction"),
    ModeFacts("unified", gen_rows="sequences", embeds=True, combined=True,
              tags=("gritlm", "sentence-similarity", "feature-extraction", "text-generation")),
    ModeFacts("preference", gen_rows="pairs", chunked_head="always", profile_packs=False, tag_key="preference"),
    ModeFacts("rl", gen_rows="questions", chunked_head="always", profile_packs=False, sections=("rft", "rl"),
              tags=("text-generation", "grpo")),
    ModeFacts("distill", gen_rows="sequences", chunked_head="always", profile_packs=False, sections=("distill",),
              tags=("text-generation", "distillation")),
)}


def register_facts(row: ModeFacts) -> None:
    """Add a mode's row (harness.modes.register calls it): `loss.mode` accepts its name from now on."""
    MODES[row.name] = row


def facts(name: str) -> ModeFacts:
    try:
        return MODES[name]
    except KeyError:
        raise ConfigError(f"config key 'loss.mode': expected one of {', '.join(map(repr, MODES))}, got {name!r}") \
            from None
