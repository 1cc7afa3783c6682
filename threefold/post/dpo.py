"""Direct preference optimisation: the ``DPOTask`` the training loop runs.

Data: a JSONL file of preference pairs (the built-in ``examples/dpo.jsonl`` by default), in
either of TRL's two formats:

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``; the end-of-text token is
  appended to each response that lacks it;
- conversational: ``{"prompt": [messages], "chosen": [assistant message(s)], "rejected":
  [...]}``, rendered with the chat template (``threefold.data.chat``), the prompt with the
  generation prompt.

As TRL does, the prompt and each prompt+response are tokenized whole and the response starts
where the prompt's tokens and both prompt+response token lists first differ. A sequence is cut
to ``data.seq_len`` tokens (its start kept); a pair whose prompt alone fills it is dropped.

Loss (Rafailov et al., "Direct Preference Optimization", arXiv 2305.18290, Eq. 7), with the
label smoothing of conservative DPO (Mitchell, "A note on DPO with noisy preferences", 2023):

    Δ = (log π(y_c|x) − log π(y_r|x)) − (log π_ref(y_c|x) − log π_ref(y_r|x))
    loss = −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ)

where log π(y|x) is the summed log-probability of the response tokens. With ε = 0 this is
TRL's ``loss_type="sigmoid"`` (TRL 1.16 applies its ``label_smoothing`` to other loss types
only, so the TRL comparison runs with ε = 0). ``dpo.loss_type`` ``ipo`` and ``hinge`` are
TRL's too (``dpo_loss``); label smoothing is refused with them. ``count`` is pairs, so
the loop's loss is the mean over the pairs of the global batch. Metrics (TRL's names), means
over pairs: ``rewards/chosen`` = β·(log π(y_c) − log π_ref(y_c)), ``rewards/rejected``
likewise, ``rewards/margins`` their difference, ``rewards/accuracies`` the share of pairs whose
chosen reward is strictly larger, and ``logps/chosen`` / ``logps/rejected``.

Reference: this is the issue's "precomputed log-probs" option. The policy equals the reference
at step 0, so ``setup`` scores every pair (training and validation) once with the initial
policy, before any update, with no gradient, through ``run.token_losses``: the same
code as training, so it works under every layout (the data-parallel ranks share the pairs
out and sum their scores: each pair is scored by one dp rank, with its tp / pipeline peers)
and needs no second model in memory. On resume the reference is scored again from the same initial
weights (``checkpoint.init_from``, or the seed's initialisation), before the checkpoint is loaded.
At step 0, then, Δ = 0 and the loss is ln 2 for any β and ε. Scoring costs one forward per
pair over the whole data set at start-up.

Under pipeline parallelism the chosen and rejected rows of a micro-batch travel as one batch
(``pipeline_micro``); the last stage computes the log-probs and the DPO loss from its logits
(``pipeline_loss``, the executor's ``task_loss``), and the reference is scored by
forward-only steps of the same executor, then sent to every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from threefold.data import DataError
from threefold.training.task import Task
from threefold.data.chat import (ChatTemplate, announce, check_messages, encode_text,
                                 eot_token, load_chat_template)
from threefold.post.sft import (IGNORE, EpochSampler, fingerprint, pad_id, split_records,
                                stack_items)


@dataclass
class DPOOptions:
    """Options of ``threefold dpo`` beyond the run configuration (``--dpo.KEY VALUE``)."""

    data: str = ""  # JSONL of prompt/chosen/rejected; "" = the built-in examples
    val_data: str = ""  # validation JSONL; "" = the last data.val_fraction of ``data``
    beta: float = 0.1  # β: strength of the pull towards the reference
    label_smoothing: float = 0.0  # ε: assumed share of flipped preference labels, in [0, 0.5)
    loss_type: str = "sigmoid"  # sigmoid (DPO), ipo or hinge, as TRL's
    chat_template: str = "auto"  # auto (tokenizer's, else built-in), builtin, or a .jinja path


LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor, beta: float,
             label_smoothing: float = 0.0, loss_type: str = "sigmoid",
             lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-pair preference loss from log π − log π_ref of the chosen and rejected responses,
    Δ = chosen − rejected:

    - ``sigmoid``: −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ) (Rafailov et al. 2023, Eq. 7; ε as in
      conservative DPO, Mitchell 2023);
    - ``hinge``: max(0, 1 − β·Δ) (SLiC, Zhao et al. 2023, as TRL's);
    - ``ipo``: (Δ' − 1/(2β))² (Azar et al. 2023, Eq. 17), where Δ' takes each response's
      log-ratio per token of it (``lengths``: response tokens of the chosen and the
      rejected), as TRL does."""
    if loss_type == "hinge":
        return torch.relu(1 - beta * (chosen_logratio - rejected_logratio))
    if loss_type == "ipo":
        n_c, n_r = (n.clamp(min=1).to(chosen_logratio.dtype) for n in lengths)
        return (chosen_logratio / n_c - rejected_logratio / n_r - 1 / (2 * beta)) ** 2
    z = beta * (chosen_logratio - rejected_logratio)
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(rec: dict, template, tok, eot: str, where: str) -> tuple[list, list, list]:
    """(prompt ids, chosen ids, rejected ids) of a record, responses without the prompt."""
    for key in ("prompt", "chosen", "rejected"):
        if key not in rec:
            raise DataError(f"{where}: record has no '{key}' (fields: {', '.join(rec)}); each "
                            "line needs prompt, chosen and rejected")
    p, c, r = rec["prompt"], rec["chosen"], rec["rejected"]
    if all(isinstance(x, str) for x in (p, c, r)):
        def closed(text: str) -> str:  # TRL appends the end token where it is missing
            return text if text.endswith(eot) else text + eot

        texts = (p, p + closed(c), p + closed(r))
    elif all(isinstance(x, list) for x in (p, c, r)):
        p = check_messages(p, where + " prompt", need_assistant=False)
        c = check_messages(c, where + " chosen")
        r = check_messages(r, where + " rejected")
        texts = (template.render(p, add_generation_prompt=True), template.render(p + c),
                 template.render(p + r))
    else:
        raise DataError(f"{where}: prompt, chosen and rejected must all be strings or all be "
                        "lists of messages")
    prompt, chosen, rejected = (list(encode_text(tok, t).ids) for t in texts)
    # Where the response starts: the tokens of the prompt alone may merge differently at its
    # end than inside prompt+response (TRL's rule: the shortest common prefix).
    n = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
    return prompt[:n], chosen[n:], rejected[n:]


def tokenize_pairs(records, template, tok, eot: str, seq_len: int, path: str,
                   stats: dict) -> list[tuple[list, list, list]]:
    """``tokenize_pair`` of every (line number, record); a pair whose prompt fills
    ``seq_len`` is dropped (no response token would count), ``stats`` counts the dropped and
    truncated ones; DataError for an empty response or when nothing is left."""
    pairs = []
    for no, rec in records:
        p, c, r = tokenize_pair(rec, template, tok, eot, f"{path}:{no}")
        if len(p) >= seq_len:
            stats["dropped"] = stats.get("dropped", 0) + 1
            continue
        if not c or not r:
            raise DataError(f"{path}:{no}: a response is empty after tokenization")
        stats["truncated"] = stats.get("truncated", 0) + (len(p) + max(len(c), len(r)) > seq_len)
        pairs.append((p, c, r))
    if not pairs:
        raise DataError(f"'{path}': every prompt fills data.seq_len={seq_len}; raise it")
    return pairs


def sequence(prompt: list[int], response: list[int], seq_len: int,
             pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of prompt+response cut and padded to ``seq_len``; labels[t] is
    token t+1 where that token belongs to the response."""
    ids = (prompt + response)[:seq_len]
    x = np.full(seq_len, pad, dtype=np.int64)
    y = np.full(seq_len, IGNORE, dtype=np.int64)
    x[:len(ids)] = ids
    first = max(len(prompt), 1)  # the first response token with a position predicting it
    y[first - 1:len(ids) - 1] = ids[first:]
    return x, y


class PairSampler(EpochSampler):
    """Preference pairs: chosen/rejected input ids and labels, reference log-probs, weight."""

    def __init__(self, pairs: list[tuple[list, list, list]], seq_len: int,
                 global_batch_size: int, seed: int, pad: int, shuffle: bool = True):
        self.seq_len, self.pad = int(seq_len), int(pad)
        self.arrays = [sequence(p, c, seq_len, pad) + sequence(p, r, seq_len, pad)
                       for p, c, r in pairs]
        self.ref: np.ndarray | None = None  # (n, 2) float64 from DPOTask.setup
        super().__init__(len(pairs), global_batch_size, seed, shuffle,
                         fingerprint((a for arrs in self.arrays for a in arrs), seq_len))

    def tensors(self, i: int) -> dict[str, np.ndarray]:
        """Pair ``i``'s token arrays."""
        xc, yc, xr, yr = self.arrays[i]
        return {"chosen_input_ids": xc, "chosen_labels": yc,
                "rejected_input_ids": xr, "rejected_labels": yr}

    def item(self, i: int) -> dict[str, np.ndarray]:
        """Pair ``i`` with its reference log-probs and weight 1."""
        if self.ref is None:
            raise RuntimeError("reference log-probs are computed in DPOTask.setup")
        out = self.tensors(i)
        out.update(ref_chosen_logps=np.float64(self.ref[i, 0]),
                   ref_rejected_logps=np.float64(self.ref[i, 1]), weight=np.float32(1.0))
        return out

    def empty(self) -> dict[str, np.ndarray]:
        """A pair of padding with weight 0."""
        x = np.full(self.seq_len, self.pad, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        return {"chosen_input_ids": x, "chosen_labels": y, "rejected_input_ids": x.copy(),
                "rejected_labels": y.copy(), "ref_chosen_logps": np.float64(0.0),
                "ref_rejected_logps": np.float64(0.0), "weight": np.float32(0.0)}


@dataclass
class PairData:
    """The tokenized preference pairs of a run (``load_pairs``): (prompt, chosen, rejected)
    id lists for training and validation, the chat template that rendered them, the
    padding id, and what loading counted (pairs, truncated, dropped; for ``announce``)."""

    train: list[tuple[list, list, list]]
    val: list[tuple[list, list, list]]
    template: ChatTemplate
    pad: int
    stats: dict

    def samplers(self, sampler: type[PairSampler], cfg) -> tuple[PairSampler, PairSampler]:
        """(training sampler, shuffled per epoch; validation sampler, in order) of class
        ``sampler``."""
        seq_len, t = cfg.data.seq_len, cfg.train
        return (sampler(self.train, seq_len, t.global_batch_size, t.seed, self.pad,
                        shuffle=True),
                sampler(self.val, seq_len, t.global_batch_size, t.seed, self.pad,
                        shuffle=False))


def load_pairs(cfg, data, options, default: str) -> PairData:
    """The pairs ``options`` name (``data``, ``val_data``, ``chat_template``: DPO's and the
    reward model's), else the built-in example file ``default``, tokenized with the run's
    tokenizer and cut to data.seq_len (``tokenize_pairs``)."""
    seq_len, tok = cfg.data.seq_len, data.tokenizer
    template = load_chat_template(data.tokenizer_path, tok, options.chat_template)
    eot = eot_token(tok, str(data.tokenizer_path))
    train_recs, val_recs, path = split_records(cfg, options.data, options.val_data, default)
    stats = {"template": template.source, "data": path}
    train = tokenize_pairs(train_recs, template, tok, eot, seq_len, path, stats)
    val = tokenize_pairs(val_recs, template, tok, eot, seq_len, options.val_data or path,
                         stats)
    stats.update(pairs=len(train), val_pairs=len(val))
    return PairData(train, val, template, pad_id(tok, data.eot_id), stats)


def rows_logps(token_losses: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's labelled tokens, (rows,) fp32: minus the sum of
    the row's token losses (the model's chunked head loss, 0 where a token has no label;
    vocab-parallel under tensor parallelism)."""
    return -token_losses.sum(-1)


def concatenated(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``micro`` with "input_ids" and "labels": the chosen rows followed by the rejected rows
    (as TRL's concatenated forward), the form a pipeline runs (``DPOTask.pipeline_micro``)."""
    return {**micro,
            "input_ids": torch.cat([micro["chosen_input_ids"], micro["rejected_input_ids"]]),
            "labels": torch.cat([micro["chosen_labels"], micro["rejected_labels"]])}


def halves(logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of per-row log-probs over ``concatenated`` rows."""
    b = logps.shape[0] // 2
    return logps[:b], logps[b:]


def trimmed(run, both: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``concatenated`` rows cut after the last column where any row has a label, rounded up
    to a multiple of 8 (and of tp under sequence parallelism): the padding after every
    response changes no log-prob (attention is causal), but a forward over it costs as much
    as over text (TRL pads to the longest pair too). Rows stay whole where the layout needs
    fixed lengths: context parallelism's 2·cp chunks, compiled blocks."""
    p, labels = run.cfg.parallel, both["labels"]
    used = (labels != -100).any(0).nonzero()
    if p.cp > 1 or run.cfg.train.compile or not len(used):
        return both
    step = 8 * (p.tp if p.sequence_parallel else 1)
    n = min(labels.shape[1], -(-(int(used[-1]) + 1) // step) * step)
    return {"input_ids": both["input_ids"][:, :n], "labels": labels[:, :n]}


def pair_logps(run, micro: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                            float]:
    """(policy log-probs (chosen, rejected) of a micro-batch of pairs, this rank's share of
    the loss), in one forward of the whole model over the ``concatenated`` rows
    (``trimmed``). Under context parallelism each cp rank runs its tokens of the rows and the
    log-probs are summed over cp (``World.sequence_sum``): every cp rank then holds whole
    sequences' log-probs and returns 1/cp of the loss."""
    both = trimmed(run, concatenated(micro))
    rows = run.world.split_sequence({"input_ids": both["input_ids"], "labels": both["labels"]})
    logps, share = run.world.sequence_sum(rows_logps(run.token_losses(rows)))
    return halves(logps), share


class DPOTask(Task):
    """DPO (sigmoid with label smoothing, IPO or hinge) against precomputed reference
    log-probs."""

    name = "dpo"
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                    "rewards/margins", "logps/chosen", "logps/rejected")

    def __init__(self, options: DPOOptions | None = None):
        self.options = options or DPOOptions()
        o = self.options
        if not o.beta > 0:
            raise DataError(f"dpo.beta: must be positive, got {o.beta}")
        if not 0 <= o.label_smoothing < 0.5:
            raise DataError(f"dpo.label_smoothing: {o.label_smoothing} must be in [0, 0.5)")
        if o.loss_type not in LOSS_TYPES:
            raise DataError(f"dpo.loss_type: '{o.loss_type}' is not one of "
                            f"{', '.join(LOSS_TYPES)}")
        if o.label_smoothing and o.loss_type != "sigmoid":
            raise DataError(f"dpo.label_smoothing: applies to loss_type sigmoid only, not "
                            f"'{o.loss_type}'; leave it 0")
        self.stats: dict = {}

    def samplers(self, cfg, data) -> tuple[PairSampler, PairSampler]:
        """Training pairs (shuffled per epoch) and validation pairs (in order)."""
        pairs = load_pairs(cfg, data, self.options, "dpo.jsonl")
        self.template, self.stats = pairs.template, pairs.stats
        self.train, self.val = pairs.samplers(PairSampler, cfg)
        return self.train, self.val

    @torch.no_grad()
    def reference_logps(self, run, sampler: PairSampler) -> np.ndarray:
        """(n, 2) summed log-probs of every pair's chosen and rejected response under the
        model as it is now. Micro-batches have the training shape (the last one is filled up
        with repeats), so a pair scores the same here as in the first training step.

        The micro-batches are shared out over the data-parallel ranks (micro-batch i to dp
        rank i mod dp; every rank runs the same number of forwards, the last ones repeats,
        so ZeRO-3's gathers stay in step) and the scores summed over dp (a rank's rows are
        zero elsewhere): the data set is scored once, not once per rank."""
        lay = run.world
        mb = min(run.cfg.train.micro_batch_size, run.cfg.train.global_batch_size // lay.dp_size)
        out = np.zeros((sampler.n, 2), dtype=np.float64)
        micros = []
        for start in range(0, sampler.n, mb):
            idx = list(range(start, min(sampler.n, start + mb)))
            items = [sampler.tensors(i) for i in idx + [idx[0]] * (mb - len(idx))]
            micro = {k: t.to(run.device) for k, t in stack_items(items).items()}
            micros.append((idx, micro))
        dp, rank = lay.dp_size, lay.dp_rank
        mine = micros[rank::dp]
        rounds = -(-len(micros) // dp)
        mine += [([], micros[0][1])] * (rounds - len(mine))  # repeats, not recorded
        pipe = lay.pipeline
        if pipe is not None:
            out = self._pipelined_reference(run, pipe, mine, out)
        else:
            for idx, micro in mine:
                for col, logps in enumerate(pair_logps(run, micro)[0]):
                    if idx:
                        out[idx[0]:idx[-1] + 1, col] = logps[:len(idx)].double().cpu().numpy()
        if dp > 1:
            ref = torch.from_numpy(out).to(run.device)
            lay.control.all_reduce(ref, "dp")
            out = ref.cpu().numpy()
        return out

    def _pipelined_reference(self, run, pipe, micros: list, out: np.ndarray) -> np.ndarray:
        """``reference_logps`` through the pipeline: forward-only steps of the executor's m
        micro-batches (the last group filled up with repeats), the last stage recording each
        row's log-prob, then sent to every stage of the pipeline (all ranks' samplers hold
        the same reference)."""

        def score(losses, micro):  # on the last stage, in place of the DPO loss
            return losses.new_zeros(()), {"logps": rows_logps(losses)}

        for g in range(0, len(micros), pipe.m):
            group = micros[g:g + pipe.m]
            pipe.evaluate([concatenated(micro) for _, micro in group]
                          + [concatenated(group[0][1])] * (pipe.m - len(group)), task_loss=score)
            for j, (idx, _) in enumerate(group):
                if idx and j in pipe.task_outputs:  # the last stage only
                    for col, logps in enumerate(halves(pipe.task_outputs[j]["logps"])):
                        out[idx[0]:idx[-1] + 1, col] = logps[:len(idx)].double().cpu().numpy()
        lay = run.world
        ref = torch.from_numpy(out).to(run.device)
        lay.control.broadcast(ref, lay.last_stage_rank, "pp")
        return ref.cpu().numpy()

    def setup(self, run) -> None:
        """Score every pair with the initial policy: the reference (see the module doc).
        Save the chat template into the run directory (writer rank)."""
        self.train.ref = self.reference_logps(run, self.train)
        self.val.ref = self.reference_logps(run, self.val)
        s = self.stats
        announce(run, self.template,
                 f"dpo: {s['pairs']} pairs ({s['val_pairs']} held out) from {s['data']}, "
                 f"template {s['template']}, beta {self.options.beta}, label smoothing "
                 f"{self.options.label_smoothing}; reference log-probs precomputed", s,
                 "prompt fills data.seq_len")

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """Pairs (empty validation fillers weigh 0)."""
        return int(batch["weight"].sum())

    def pipeline_micro(self, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The micro-batch as a pipeline runs it: chosen then rejected rows as one batch."""
        return concatenated(micro)

    def pipeline_loss(self, run, losses: torch.Tensor, micro: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, dict]:
        """``loss`` on a pipeline's last stage, from the token losses of the concatenated
        rows."""
        return self._dpo(micro, halves(rows_logps(losses)))

    def loss(self, run, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Summed DPO loss of the micro-batch's pairs and summed metrics (this cp rank's
        share of them, ``pair_logps``)."""
        return self._dpo(micro, *pair_logps(run, micro))

    def _dpo(self, micro: dict[str, torch.Tensor], logps: tuple[torch.Tensor, torch.Tensor],
             share: float = 1.0) -> tuple[torch.Tensor, dict]:
        chosen, rejected = logps
        o = self.options
        w = micro["weight"].double()
        # log-ratios in fp64: at step 0 policy and reference scores are the same fp32 numbers,
        # so Δ is exactly 0 and the loss exactly ln 2
        lr_c = chosen.double() - micro["ref_chosen_logps"]
        lr_r = rejected.double() - micro["ref_rejected_logps"]
        lengths = tuple((micro[f"{k}_labels"] != IGNORE).sum(dim=1)
                        for k in ("chosen", "rejected"))
        total = (dpo_loss(lr_c, lr_r, o.beta, o.label_smoothing, o.loss_type, lengths)
                 * w).sum()
        rc, rr = o.beta * lr_c.detach(), o.beta * lr_r.detach()
        metrics = {"rewards/chosen": (rc * w).sum(), "rewards/rejected": (rr * w).sum(),
                   "rewards/accuracies": ((rc > rr).double() * w).sum(),
                   "rewards/margins": ((rc - rr) * w).sum(),
                   "logps/chosen": (chosen.detach().double() * w).sum(),
                   "logps/rejected": (rejected.detach().double() * w).sum()}
        if share != 1.0:
            total, metrics = total * share, {k: v * share for k, v in metrics.items()}
        return total.float(), metrics
