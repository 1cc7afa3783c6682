"""The mesh axes, named once: the layout's rank arithmetic (``threefold.layout.ranks``), the
runtime's mesh (``threefold.comm.mesh``) and the accounting (``threefold.accounting``) all read
these tables, from here alone.

Axis order, outermost (largest rank stride) to innermost (stride 1), is ``AXES``: tp innermost
so that its ranks are neighbours (same node, NVLink), then cp, then dp_shard, then
dp_replicate and pp outermost, where traffic is lightest (a mesh's inner axes carry the most
bytes, so they stay on the fastest links: docs/parallelisms.md, the mesh).

Imports nothing of threefold.
"""

from __future__ import annotations

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh axes, outermost (largest rank stride) to innermost (stride 1)."""

FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp")}
"""Axes made of mesh axes (outermost first): ``dp`` the data ranks (where plain data
parallelism all-reduces with cp = 1), ``dp_cp`` the data and context ranks (which hold the
same weights: gradients are reduced over them with cp > 1), and ``dp_shard_cp`` the ZeRO shard
group (as torchtitan folds cp into its FSDP axis). With cp = 1 these are dp and dp_shard."""

EXPERT_AXES = ("ep", "edp_shard", "edp")
"""Axes of a mixture of experts, carved out of dp_shard (which is its outer part × ep, ep
innermost) and cp: ``ep`` the ranks whose experts together make a layer's E experts (tokens
travel between them by all-to-all), ``edp_shard`` the ranks of one shard group that hold the
same experts, dp_shard's outer part × cp (ZeRO shards the experts over them; cp ranks route
other tokens of the same sequences), ``edp`` those with dp_replicate too (plain data
parallelism sums the experts' gradients over them). With ep = 1, edp is dp_cp and edp_shard
is dp_shard_cp."""

EP_LEVELS = ("ep_inter", "ep_intra")
"""The two levels of the hierarchical expert dispatch (``parallel.ep_dispatch hierarchical``),
ep = ep_inter × ep_intra, ep_intra innermost: ``ep_intra`` the ep ranks of one node (tokens
fan out over NVLink among them), ``ep_inter`` the ep ranks with the same local index on every
node the ep group spans (each token crosses the network once per destination node between
them). Under the flat dispatch ep_intra is ep and ep_inter 1."""

CP_AXES = ("cp_inner", "cp_outer")
"""Axes of hybrid context parallelism, carved out of cp (which is cp_outer × cp_inner,
cp_inner innermost): ``cp_inner`` the ``Layout.ulysses`` neighbouring ranks that trade sequence
shards for head shards by all-to-all (Ulysses; inside a node), ``cp_outer`` the ranks with the
same cp_inner index, which run the ring or the all-gather over the shares (they may cross
nodes). Used only when both are above 1; a pure algorithm runs on "cp" itself."""

DERIVED_AXES = (*FLATTENED, *EXPERT_AXES, *EP_LEVELS, *CP_AXES, "world")
"""Axes made of other axes, plus ``world`` (every rank)."""

COMM_AXES = AXES + tuple(FLATTENED) + EXPERT_AXES + EP_LEVELS + CP_AXES
"""Axes communication is counted on (the keys of ``comm_bytes_per_step``)."""
