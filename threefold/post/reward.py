"""Reward modelling: the ``RewardTask`` the training loop runs (``threefold reward``).

A reward model is the decoder with its LM head replaced by a *score head*: one linear map of
the final normed hidden state to a scalar, no bias (transformers' ``score.weight`` of
``LlamaForSequenceClassification`` with ``num_labels=1``), read at the last non-padding token
of each sequence. "Last non-padding" is transformers' rule exactly: the rightmost position
whose id is not the padding id, so an exported model scores a right-padded row as we do.

Data: the preference pairs of DPO (``threefold.post.dpo``; prompt/chosen/rejected, TRL's
standard or conversational format, the built-in ``examples/reward.jsonl`` by default); each
of prompt+chosen and prompt+rejected is scored whole.

Loss (Bradley–Terry, as in Ouyang et al., "Training language models to follow instructions
with human feedback", arXiv 2203.02155, Eq. 1), per pair, with TRL's optional centring term
(Eisenstein et al., arXiv 2312.09244):

    loss = −log σ(r_c − r_r) + c·(r_c + r_r)²

``count`` is pairs, so the loop's loss is the mean over the pairs of the global batch, under
any accumulation and data-parallel degree. Metrics (TRL's RewardTrainer names), means over
pairs: ``accuracy`` (share of pairs with r_c > r_r), ``margin`` (r_c − r_r), ``mean_reward``
(the mean of r_c and r_r).

Model: ``build_run`` builds the reward model directly (``RewardTask.adapt_model`` puts the
``score`` head in place of the LM head on the meta model; the decoder comes from
``checkpoint.init_from`` as for SFT and DPO, the head from the seed, ``new_weights``). Under tensor
parallelism the score head is replicated: without sequence parallelism its input is the replicated
residual stream; with it, each rank scores its own positions and the (B, T) scores are all-gathered
(the weight's gradient summed over tp, as for sequence-parallel norms). Under context
parallelism each cp rank scores its positions and the last token's score is summed over cp.
Pipeline parallelism is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from threefold.layout import task_layout
from threefold.data import DataError
from threefold.model.decoder import initial_weight
from threefold.parallel.transforms.tp_ops import copy_to_tp
from threefold.parallel.transforms.tensor import gather_full
from threefold.data.chat import announce, read_jsonl
from threefold.post.dpo import PairSampler, load_pairs
from threefold.training.task import Task
from threefold.training.run import autocast


@dataclass
class RewardOptions:
    """Options of ``threefold reward`` beyond the run configuration (``--reward.KEY VALUE``)."""

    data: str = ""  # JSONL of prompt/chosen/rejected; "" = the built-in examples
    val_data: str = ""  # validation JSONL; "" = the last data.val_fraction of ``data``
    center_rewards_coefficient: float = 0.0  # c: weight of (r_c + r_r)² (TRL's option)
    chat_template: str = "auto"  # auto (tokenizer's, else built-in), builtin, or a .jinja path


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       center: float = 0.0) -> torch.Tensor:
    """Per-pair −log σ(r_c − r_r) + center·(r_c + r_r)²."""
    loss = -F.logsigmoid(chosen - rejected)
    return loss + center * (chosen + rejected) ** 2 if center else loss


def last_token_index(input_ids: torch.Tensor, pad: int) -> torch.Tensor:
    """(B,) index of each row's rightmost token that is not ``pad`` (0 for a row of padding):
    transformers' rule for sequence classification."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad)).argmax(-1)


def check_pairs_file(path: str) -> None:
    """DataError naming ``path`` and the line of the first record that is not a preference
    pair (not JSON, a field missing, or fields of mixed kinds); checked before launch, so a
    bad file stops every rank before anything is written."""
    for no, rec in read_jsonl(path):
        where = f"{path}:{no}"
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
        if missing:
            raise DataError(f"{where}: record has no '{missing[0]}' (fields: "
                            f"{', '.join(rec) or 'none'}); each line needs prompt, chosen and "
                            "rejected")
        kinds = {type(rec[k]) for k in ("prompt", "chosen", "rejected")}
        if kinds not in ({str}, {list}):
            raise DataError(f"{where}: prompt, chosen and rejected must all be strings or all "
                            "be lists of messages")


class RewardSampler(PairSampler):
    """Preference pairs as chosen/rejected input ids (right-padded) and a weight."""

    def item(self, i: int) -> dict[str, np.ndarray]:
        """Pair ``i`` with weight 1."""
        xc, _, xr, _ = self.arrays[i]
        return {"chosen_input_ids": xc, "rejected_input_ids": xr, "weight": np.float32(1.0)}

    def empty(self) -> dict[str, np.ndarray]:
        """A pair of padding with weight 0."""
        x = np.full(self.seq_len, self.pad, dtype=np.int64)
        return {"chosen_input_ids": x, "rejected_input_ids": x.copy(),
                "weight": np.float32(0.0)}


class _GatherScores(torch.autograd.Function):
    """(B, T/t) per-position scores of this tp rank's sequence chunk -> (B, T) on every rank;
    backward keeps this rank's slice (every rank's loss is the same function of the whole)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.r, ctx.n = comm.rank("tp"), x.shape[1]
        return gather_full(x, 1, x.shape[1] * comm.size("tp"), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.r * ctx.n:(ctx.r + 1) * ctx.n].contiguous(), None


def add_score_head(model: nn.Module, seed: int) -> nn.Module:
    """``model`` (a not yet parallelised ``CausalLM``) as a reward model in place: no
    LM head (its forward returns the final hidden states) and ``score``, a hidden -> 1 linear
    without bias, drawn from normal(0, init_std) by a generator seeded by (seed, its name) as
    ``init_weights`` draws every weight."""
    ref = model.model.norm.weight
    model.lm_head = None
    model.score = nn.Linear(model.cfg.hidden_size, 1, bias=False, device=ref.device,
                            dtype=ref.dtype)
    if not ref.is_meta:  # else filled later by name, drawing the same values
        with torch.no_grad():
            model.score.weight.copy_(initial_weight("score.weight", (1, model.cfg.hidden_size),
                                                    model.cfg, seed, ref.device))
    return model


class RewardTask(Task):
    """A sequence-scoring head trained with the Bradley–Terry loss on preference pairs."""

    name = "reward"
    metric_names = ("accuracy", "margin", "mean_reward")

    def __init__(self, options: RewardOptions | None = None):
        self.options = options or RewardOptions()
        if not self.options.center_rewards_coefficient >= 0:
            raise DataError("reward.center_rewards_coefficient: must be >= 0, got "
                            f"{self.options.center_rewards_coefficient}")
        self.stats: dict = {}

    @staticmethod
    def check_layout(cfg) -> None:
        """ConfigError for the layouts reward training does not run under."""
        task_layout("reward", cfg)  # the rule book's

    def samplers(self, cfg, data) -> tuple[RewardSampler, RewardSampler]:
        """Training pairs (shuffled per epoch) and validation pairs (in order)."""
        self.check_layout(cfg)
        pairs = load_pairs(cfg, data, self.options, "reward.jsonl")
        self.template, self.stats, self.pad = pairs.template, pairs.stats, pairs.pad
        self.train, self.val = pairs.samplers(RewardSampler, cfg)
        return self.train, self.val

    new_weights = ("score.weight",)  # drawn from the seed even on a pretrained decoder

    def adapt_model(self, model: nn.Module) -> nn.Module:
        """The reward model on the (meta) causal LM, before it is parallelised: the score
        head in place of the LM head (see the module doc)."""
        return add_score_head(model, 0)

    def setup(self, run) -> None:
        """Announce the data."""
        s = self.stats
        announce(run, self.template,
                 f"reward: {s['pairs']} pairs ({s['val_pairs']} held out) from {s['data']}, "
                 f"template {s['template']}, score head {run.model_cfg.hidden_size} -> 1",
                 s, "prompt fills data.seq_len")

    def scores(self, run, input_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """((B,) fp32 score of each row: the score head at its last non-padding token, this
        rank's share of the loss). Under context parallelism each cp rank scores its own
        positions and the one at the row's last token is summed over cp
        (``World.sequence_sum``): every cp rank holds every score and returns 1/cp of the
        loss."""
        model = run.engine.model
        mine = run.world.split_sequence({"input_ids": input_ids})  # this cp rank's tokens
        hidden = run.forward(mine)  # (B, T, h): the model has no LM head
        last = last_token_index(input_ids, self.pad)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        with autocast(run):
            if model.sequence_parallel:  # this rank holds positions [r·T/t, (r+1)·T/t)
                comm = run.world.comm
                # each rank scores its own positions: the replicated head's gradient is
                # the sum over tp, as for sequence-parallel norms
                per_pos = F.linear(hidden, copy_to_tp(model.score.weight, comm))
                per_pos = _GatherScores.apply(per_pos[..., 0].float(), comm)
            elif "position_ids" in mine:  # a cp rank's positions: score them all
                per_pos = model.score(hidden)[..., 0].float()
            else:
                return model.score(hidden[rows, last])[:, 0].float(), 1.0
        if "position_ids" not in mine:
            return per_pos[rows, last], 1.0
        at_last = mine["position_ids"] == last[:, None]  # on one cp rank of each row
        return run.world.sequence_sum((per_pos * at_last).sum(1))

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Pairs (empty validation fillers weigh 0)."""
        return int(batch["weight"].sum())

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Summed Bradley–Terry loss of the micro-batch's pairs and summed metrics; chosen and
        rejected rows go through the model as one batch."""
        b = micro["chosen_input_ids"].shape[0]
        both, share = self.scores(run, torch.cat([micro["chosen_input_ids"],
                                                  micro["rejected_input_ids"]]))
        rc, rr = both[:b], both[b:]
        w = micro["weight"].to(both.dtype)
        total = (bradley_terry_loss(rc, rr, self.options.center_rewards_coefficient) * w).sum()
        rc, rr, w = rc.detach().double(), rr.detach().double(), w.double()
        metrics = {"accuracy": ((rc > rr).double() * w).sum(),
                   "margin": ((rc - rr) * w).sum(),
                   "mean_reward": ((rc + rr) / 2 * w).sum()}
        if share != 1.0:  # each cp rank's share of the loss of whole sequences
            total, metrics = total * share, {k: v * share for k, v in metrics.items()}
        return total, metrics
