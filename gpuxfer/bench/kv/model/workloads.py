"""KV-cache workloads: what one request's KV is made of, region by region.

A :class:`Workload` is a tuple of :class:`Region` s. A region is one cache of the
model (the compressed-attention cache of 30 layers, the sliding window of 61
layers...): how many layers it spans, how many bytes one *entry* holds, how
many tokens one entry covers, how a page of ``page_tokens`` tokens maps onto
entries, and whether it grows with the input length or holds a fixed window.

At a page size a workload resolves into :class:`TransferRegion` s, the units
a descriptor addresses:

* an *unpacked* region (the CollectiveX model, per-layer caches) moves one
  descriptor per (layer, page): ``planes == layers``;
* regions that share a ``pack_group`` are stored packed: all their layers of one
  block are one contiguous slab, so one descriptor per block moves every layer
  of the group (vLLM's packed DeepSeek-V4 layout): ``planes == 1``.

Every count here is exact integer arithmetic:

* tokens a region holds for a request: ``isl`` (grows with input) or
  ``min(isl, window_tokens)``;
* pages: ``ceil(tokens / tokens_per_page)`` where ``tokens_per_page =
  entries_per_page * tokens_per_entry``;
* descriptors: ``planes * pages``; bytes: ``planes * pages * desc_bytes`` (a page
  is the transfer unit, so a partly filled last page moves whole).

These reproduce the CollectiveX kv-transfer suite's counts
(SemiAnalysisAI/InferenceX PR #2510, ``experimental/CollectiveX/bench/kv_workload.py``,
``plan_config``): a 32k-token ``kv-dsv4`` request is 131,304 descriptors at
16-token pages and 38,778 at 64-token pages, 183,066,624 bytes either way; 512k
at 16-token pages is 2,093,544 descriptors.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from ....errors import BadInput

__all__ = [
    "PageMap", "Region", "TransferRegion", "RequestShape", "Workload",
    "WORKLOADS", "get_workload", "workload_names", "dsv4_vllm_workload", "SLAB_SPACE",
]

#: Name of the page (block-ID) space shared by every packed group of a workload:
#: in vLLM's packed layout a block ID is owned by one cache group at a time, so all
#: groups draw their blocks from one pool of slabs.
SLAB_SPACE = "slab"


class PageMap(str, Enum):
    """How a page of ``page_tokens`` tokens maps onto a region's entries."""

    #: ``page_tokens / tokens_per_entry`` entries per page; the page size must be a
    #: multiple of ``tokens_per_entry``.
    SCALE = "scale"
    #: The suite's rule for heavily compressed regions, ``max(1, page // tokens_per_entry)``:
    #: one entry per page when the page is smaller than an entry's span. gpuxfer is
    #: strict where the suite truncates: the page must divide ``tokens_per_entry``
    #: or be a multiple of it.
    AT_LEAST_ONE = "at-least-one"
    #: The region has its own fixed block of ``fixed_page_tokens`` whatever the page
    #: size asked for (vLLM's 64-token sliding-window blocks).
    FIXED = "fixed"


def _pos_int(value, what: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{what} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise BadInput(f"{what} must be {'>= 0' if allow_zero else 'positive'}, got {value}")
    return value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Region:
    """One cache of the model, in the units a transfer sees.

    ``bytes_per_entry`` and ``tokens_per_entry`` describe one stored entry (one
    token for an uncompressed cache; ``tokens_per_entry`` tokens for a compressed
    one). ``window_tokens`` is ``None`` for a region that grows with the input,
    else the fixed number of most recent tokens it holds. ``page_align_bytes``
    pads one layer's page up to a multiple (vLLM pads fp8_ds_mla pages to 576 B).
    Regions with the same ``pack_group`` are stored as one slab per block.
    """

    name: str
    layers: int
    bytes_per_entry: int
    tokens_per_entry: int
    page_map: PageMap = PageMap.SCALE
    window_tokens: int | None = None
    fixed_page_tokens: int | None = None
    page_align_bytes: int = 1
    pack_group: str | None = None
    dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise BadInput(f"region name must be a non-empty string, got {self.name!r}")
        _pos_int(self.layers, f"region {self.name!r}: layers")
        _pos_int(self.bytes_per_entry, f"region {self.name!r}: bytes_per_entry")
        _pos_int(self.tokens_per_entry, f"region {self.name!r}: tokens_per_entry")
        _pos_int(self.page_align_bytes, f"region {self.name!r}: page_align_bytes")
        try:
            object.__setattr__(self, "page_map", PageMap(self.page_map))
        except ValueError:
            raise BadInput(f"region {self.name!r}: unknown page_map {self.page_map!r}; "
                           f"known: {', '.join(m.value for m in PageMap)}") from None
        if self.window_tokens is not None:
            _pos_int(self.window_tokens, f"region {self.name!r}: window_tokens")
        if self.page_map is PageMap.FIXED:
            if self.fixed_page_tokens is None:
                raise BadInput(f"region {self.name!r}: page_map 'fixed' needs fixed_page_tokens")
            _pos_int(self.fixed_page_tokens, f"region {self.name!r}: fixed_page_tokens")
            if self.fixed_page_tokens % self.tokens_per_entry:
                raise BadInput(f"region {self.name!r}: fixed_page_tokens {self.fixed_page_tokens} is not a "
                               f"multiple of tokens_per_entry {self.tokens_per_entry}")
        elif self.fixed_page_tokens is not None:
            raise BadInput(f"region {self.name!r}: fixed_page_tokens is only for page_map 'fixed'")
        if self.pack_group is not None and (not isinstance(self.pack_group, str) or not self.pack_group):
            raise BadInput(f"region {self.name!r}: pack_group must be a non-empty string or None")

    def entries_per_page(self, page_tokens: int) -> int:
        """Entries one page holds; raises :class:`BadInput` if the page size cannot map."""
        _pos_int(page_tokens, "page size (tokens)")
        tpe = self.tokens_per_entry
        if self.page_map is PageMap.FIXED:
            return self.fixed_page_tokens // tpe
        if self.page_map is PageMap.SCALE:
            if page_tokens % tpe:
                raise BadInput(f"page size {page_tokens} tokens cannot map region {self.name!r}: it stores "
                               f"{tpe} tokens per entry, so a page must be a multiple of {tpe} tokens")
            return page_tokens // tpe
        # AT_LEAST_ONE
        if page_tokens % tpe and tpe % page_tokens:
            raise BadInput(f"page size {page_tokens} tokens cannot map region {self.name!r}: it stores "
                           f"{tpe} tokens per entry, so a page must divide {tpe} or be a multiple of it")
        return max(1, page_tokens // tpe)

    def tokens_per_page(self, page_tokens: int) -> int:
        """Input tokens one page of this region covers."""
        return self.entries_per_page(page_tokens) * self.tokens_per_entry

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes of one layer's page, padded to ``page_align_bytes``."""
        return _round_up(self.entries_per_page(page_tokens) * self.bytes_per_entry, self.page_align_bytes)

    def tokens_held(self, isl_tokens: int) -> int:
        """Tokens of an ``isl_tokens`` request this region holds."""
        _pos_int(isl_tokens, "input length (tokens)")
        return isl_tokens if self.window_tokens is None else min(isl_tokens, self.window_tokens)

    def pages_per_request(self, isl_tokens: int, page_tokens: int) -> int:
        """Pages per layer one request fills."""
        return -(-self.tokens_held(isl_tokens) // self.tokens_per_page(page_tokens))


@dataclass(frozen=True)
class TransferRegion:
    """What a descriptor addresses at one page size: one region, or one packed group.

    ``planes`` descriptors per page (the layers of an unpacked region; 1 for a packed
    group), each of ``desc_bytes``. ``page_space`` names the pool of page (block)
    indices its block table draws from: an unpacked region has its own, all packed
    groups share :data:`SLAB_SPACE`.
    """

    name: str
    members: tuple[str, ...]
    planes: int
    desc_bytes: int
    tokens_per_page: int
    window_tokens: int | None
    page_space: str
    packed: bool

    def tokens_held(self, isl_tokens: int) -> int:
        _pos_int(isl_tokens, "input length (tokens)")
        return isl_tokens if self.window_tokens is None else min(isl_tokens, self.window_tokens)

    def pages_per_request(self, isl_tokens: int) -> int:
        return -(-self.tokens_held(isl_tokens) // self.tokens_per_page)

    def descriptors_per_request(self, isl_tokens: int) -> int:
        return self.planes * self.pages_per_request(isl_tokens)

    def bytes_per_request(self, isl_tokens: int) -> int:
        return self.descriptors_per_request(isl_tokens) * self.desc_bytes


@dataclass(frozen=True)
class RequestShape:
    """One request of a workload at (input length, page size), with its per-region breakdown."""

    workload: str
    isl_tokens: int
    page_tokens: int
    bytes: int
    descriptors: int
    # (transfer region name, planes, pages, desc_bytes) in plan order
    regions: tuple[tuple[str, int, int, int], ...]

    @property
    def mean_desc_bytes(self) -> float:
        return self.bytes / self.descriptors


@dataclass(frozen=True)
class Workload:
    """A named KV-cache shape: regions in pool and plan order.

    ``allowed_pages`` restricts the page sizes (None: any size every region maps);
    ``default_pages`` is what a sweep uses when no page size is asked for.
    """

    name: str
    regions: tuple[Region, ...]
    description: str = ""
    sources: tuple[str, ...] = ()
    allowed_pages: tuple[int, ...] | None = None
    default_pages: tuple[int, ...] = (16, 64)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise BadInput(f"workload name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.regions or not all(isinstance(r, Region) for r in self.regions):
            raise BadInput(f"workload {self.name!r}: regions must be a non-empty sequence of Region")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise BadInput(f"workload {self.name!r}: duplicate region names in {names}")
        groups = {r.pack_group for r in self.regions if r.pack_group is not None}
        # a pack group may share its name with a region only when that region is its sole member
        clash = {g for g in groups & set(names)
                 if [r.name for r in self.regions if r.pack_group == g] != [g]}
        if clash or SLAB_SPACE in names:
            raise BadInput(f"workload {self.name!r}: pack group / region names must differ "
                           f"(and {SLAB_SPACE!r} is reserved): {sorted(clash | ({SLAB_SPACE} & set(names)))}")
        if self.allowed_pages is not None:
            object.__setattr__(self, "allowed_pages", tuple(self.allowed_pages))
            if not self.allowed_pages:
                raise BadInput(f"workload {self.name!r}: allowed_pages must not be empty")
            for p in self.allowed_pages:
                _pos_int(p, f"workload {self.name!r}: allowed page size")
        object.__setattr__(self, "default_pages", tuple(self.default_pages))
        if not self.default_pages:
            raise BadInput(f"workload {self.name!r}: default_pages must not be empty")
        for p in self.default_pages:
            self.check_page(p)  # a preset's own defaults must map

    # ------------------------------------------------------------------ pages

    def check_page(self, page_tokens: int) -> None:
        """Raise :class:`BadInput` if this workload cannot use pages of ``page_tokens``."""
        _transfer_regions(self, _pos_int(page_tokens, "page size (tokens)"))

    def supports_page(self, page_tokens: int) -> bool:
        try:
            self.check_page(page_tokens)
        except BadInput:
            return False
        return True

    def transfer_regions(self, page_tokens: int) -> tuple[TransferRegion, ...]:
        """The descriptor units at ``page_tokens``, in plan order."""
        return _transfer_regions(self, _pos_int(page_tokens, "page size (tokens)"))

    @property
    def packed(self) -> bool:
        return any(r.pack_group is not None for r in self.regions)

    # ------------------------------------------------------------------ counts

    def pages_per_request(self, isl_tokens: int, page_tokens: int) -> dict[str, int]:
        """Pages (per plane) one request fills in each transfer region."""
        return {t.name: t.pages_per_request(isl_tokens) for t in self.transfer_regions(page_tokens)}

    def descriptors_per_request(self, isl_tokens: int, page_tokens: int) -> int:
        return sum(t.descriptors_per_request(isl_tokens) for t in self.transfer_regions(page_tokens))

    def bytes_per_request(self, isl_tokens: int, page_tokens: int) -> int:
        return sum(t.bytes_per_request(isl_tokens) for t in self.transfer_regions(page_tokens))

    def request_shape(self, isl_tokens: int, page_tokens: int) -> RequestShape:
        trs = self.transfer_regions(page_tokens)
        rows = tuple((t.name, t.planes, t.pages_per_request(isl_tokens), t.desc_bytes) for t in trs)
        return RequestShape(
            workload=self.name, isl_tokens=isl_tokens, page_tokens=page_tokens,
            bytes=sum(pl * pg * b for _, pl, pg, b in rows),
            descriptors=sum(pl * pg for _, pl, pg, _ in rows),
            regions=rows,
        )

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "sources": list(self.sources),
            "allowed_pages_tokens": None if self.allowed_pages is None else list(self.allowed_pages),
            "default_pages_tokens": list(self.default_pages),
            "regions": [{
                "name": r.name, "layers": r.layers, "bytes_per_entry": r.bytes_per_entry,
                "tokens_per_entry": r.tokens_per_entry, "page_map": r.page_map.value,
                "window_tokens": r.window_tokens, "fixed_page_tokens": r.fixed_page_tokens,
                "page_align_bytes": r.page_align_bytes, "pack_group": r.pack_group, "dtype": r.dtype,
            } for r in self.regions],
        }


@functools.lru_cache(maxsize=256)
def _transfer_regions(workload: Workload, page_tokens: int) -> tuple[TransferRegion, ...]:
    if workload.allowed_pages is not None and page_tokens not in workload.allowed_pages:
        raise BadInput(f"workload {workload.name!r} cannot use {page_tokens}-token pages: it only takes its "
                       f"native block size{'s' if len(workload.allowed_pages) > 1 else ''} "
                       f"{', '.join(map(str, workload.allowed_pages))} tokens")
    out: list[TransferRegion] = []
    seen_groups: set[str] = set()
    for region in workload.regions:
        region.entries_per_page(page_tokens)  # raises if unmappable
        if region.pack_group is None:
            out.append(TransferRegion(
                name=region.name, members=(region.name,), planes=region.layers,
                desc_bytes=region.page_bytes(page_tokens), tokens_per_page=region.tokens_per_page(page_tokens),
                window_tokens=region.window_tokens, page_space=region.name, packed=False))
            continue
        group = region.pack_group
        if group in seen_groups:
            continue
        seen_groups.add(group)
        members = [r for r in workload.regions if r.pack_group == group]
        tpp = {r.tokens_per_page(page_tokens) for r in members}
        windows = {r.window_tokens for r in members}
        if len(tpp) != 1 or len(windows) != 1:
            raise BadInput(f"workload {workload.name!r}: pack group {group!r} mixes regions whose blocks cover "
                           f"different tokens ({sorted(tpp)}) or windows ({sorted(map(str, windows))}) at "
                           f"{page_tokens}-token pages; a packed block must be one slab")
        out.append(TransferRegion(
            name=group, members=tuple(r.name for r in members), planes=1,
            desc_bytes=sum(r.layers * r.page_bytes(page_tokens) for r in members),
            tokens_per_page=tpp.pop(), window_tokens=windows.pop(), page_space=SLAB_SPACE, packed=True))
    return tuple(out)


# ============================================================================ presets

_SUITE = ("CollectiveX kv-transfer suite: SemiAnalysisAI/InferenceX PR #2510, "
          "experimental/CollectiveX/bench/kv_workload.py (PRESETS['dsv4'], plan_config)")

#: DeepSeek-V4-Pro as the CollectiveX suite models it.
KV_DSV4 = Workload(
    name="kv-dsv4",
    description=(
        "DeepSeek-V4-Pro as the CollectiveX kv-transfer suite models it (fp8, per-layer regions, one "
        "descriptor per (region, layer, page)): 30 compressed-sparse-attention layers at 4 tokens per 576 B "
        "entry, their 132 B lightning-indexer entries, 31 heavily-compressed layers at 128 tokens per 576 B "
        "entry (one entry per page at 16/64-token pages), and the 128-token sliding window on all 61 layers."),
    sources=(
        _SUITE,
        "DeepSeek-V4-Pro config: compress_ratios interleave 30 CSA (m=4) and 31 HCA (m'=128) layers",
        "vLLM vllm/models/deepseek_v4/attention.py: 'page-size specs pick the 576B per-token slot'; "
        "indexer entry 128 fp8 + 4 B scale = 132 B",
    ),
    regions=(
        Region("csa", layers=30, bytes_per_entry=576, tokens_per_entry=4, page_map=PageMap.SCALE,
               dtype="fp8_ds_mla: 448 fp8 NoPE + 64 bf16 RoPE (UE8M0 block-scaled)"),
        Region("csa-idx", layers=30, bytes_per_entry=132, tokens_per_entry=4, page_map=PageMap.SCALE,
               dtype="lightning-indexer key: 128 fp8 + 4 B fp32 scale"),
        Region("hca", layers=31, bytes_per_entry=576, tokens_per_entry=128, page_map=PageMap.AT_LEAST_ONE,
               dtype="fp8_ds_mla 576 B slot"),
        Region("window", layers=61, bytes_per_entry=576, tokens_per_entry=1, page_map=PageMap.SCALE,
               window_tokens=128, dtype="fp8_ds_mla 576 B slot, uncompressed sliding window"),
    ),
)

#: vLLM pads fp8_ds_mla pages (and the MLA-spec indexer pages) to multiples of 576 B.
VLLM_DSV4_PAGE_ALIGN_BYTES = 576
#: vLLM's DeepSeek-V4 block size: DeepseekSparseSWABackend.get_preferred_block_size, the Dynamo recipe.
VLLM_DSV4_BLOCK_TOKENS = 256
#: vLLM's fixed sliding-window block size for DeepSeek-V4 (sparse_swa.py).
VLLM_DSV4_SWA_BLOCK_TOKENS = 64


def dsv4_vllm_workload(indexer_bytes_per_entry: int = 132, *, name: str = "kv-dsv4-vllm") -> Workload:
    """DeepSeek-V4-Pro as vLLM allocates it, in its packed per-block layout.

    What vLLM stores (sources in ``Workload.sources``):

    * fp8_ds_mla slots are **584 B** per token/entry: 448 B fp8 NoPE + 128 B bf16 RoPE +
      8 B scale footer (``MLAAttentionSpec.real_page_size_bytes``; the compressor's fused
      store writes ``token_stride = 576`` values plus ``scale_dim = 8``; HiSparse's
      ``row_width=584, row_value_bytes=576``). Pages are padded to multiples of 576 B
      (``_apply_alignment_padding``, ``alignment=576``).
    * Blocks are **256 tokens** (``--block-size 256``; ``get_preferred_block_size``): a C4A
      (compress-4) block holds 64 entries = 37,376 B, padded 37,440 B; a C128A block holds
      2 entries = 1,168 B, padded 1,728 B; the C4A lightning indexer 64 x 132 B = 8,448 B,
      padded 8,640 B (68 B rows with the opt-in MXFP4 indexer: 4,608 B).
    * The sliding window (128 tokens, all 61 layers) is its own cache with a **fixed
      64-token block** (37,440 B per layer), whatever the main block size.
    * **Packed layout** (vLLM PR #44577, ``_get_packed_kv_cache_layout`` in
      ``vllm/v1/core/kv_cache_utils.py``): every cache group lays its layers densely into
      one per-block slab; a block ID is owned by one group at a time, so groups overlay
      the same slabs and the slab stride is the largest group stack. The full-MLA group
      (30 C4A + 30 indexer + 31 C128A) stacks to 1,435,968 B with the fp8 indexer
      (1,315,008 B with MXFP4 -- exactly the FlashMLA block stride vLLM PR #48993 reports
      for V4-Pro). The SWA layers are split into tuple-groups to align their layer-tuple
      count with the full-MLA group's 31 (``_get_kv_cache_groups_uniform_groups``:
      ``cdiv(61, 31) = 2`` groups, ``layers[i::2]`` -> 31 and 30 layers; derived).
      One descriptor moves one block of one group.

    Page size: this workload only takes its native 256-token block (any other page size
    raises :class:`BadInput`): vLLM cannot serve DSV4 on 16- or 64-token main blocks (a
    C128A block would hold less than one entry), and the SWA blocks stay 64 tokens.

    Left out, as the suite leaves them out: the fp32 compressor-state caches (C4: 4-token
    blocks, C128: 8-token blocks) and the MTP layer's cache. A finished prefill is assumed
    to end on a block boundary, so the 128-token window is 2 SWA blocks (vLLM may hold 3).
    """
    return Workload(
        name=name,
        description=(
            "DeepSeek-V4-Pro as vLLM allocates it: 584 B fp8_ds_mla slots (576 B + 8 B scale footer) in "
            "576-aligned pages, 256-token blocks (64 C4A entries, 2 C128A entries, 64 indexer entries per "
            f"block, indexer {indexer_bytes_per_entry} B/entry), 64-token sliding-window blocks, packed so "
            "one descriptor moves all layers of a group's block (one ~1.4 MB slab per 256 tokens)."),
        sources=(
            "vllm-project/vllm vllm/v1/kv_cache_interface.py: MLAAttentionSpec / SlidingWindowMLASpec "
            "real_page_size_bytes '448B NoPE + 128B RoPE + 8B fp8 scale = 584B', alignment 576, "
            "storage_block_size = block_size // compress_ratio",
            "vllm-project/vllm vllm/models/deepseek_v4/attention.py, compressor.py (token_stride 576, "
            "scale_dim 8; DeepseekV4IndexerCache 128 fp8 + 4 B scale = 132 B, MXFP4 64 + 4 = 68 B)",
            "vllm-project/vllm vllm/v1/attention/backends/mla/sparse_swa.py: SWA block_size 64, "
            "get_preferred_block_size 256, kv cache shape (num_blocks, block_size, 584)",
            "vllm-project/vllm vllm/v1/core/kv_cache_utils.py: _get_packed_kv_cache_layout, "
            "_get_kv_cache_groups_uniform_groups, group_and_unify_kv_cache_specs",
            "vllm-project/vllm PR #44577 (pack DSV4 KV caches into contiguous per-block allocations: "
            "92 regions -> 1 region per block), PR #48993 (block stride 1,315,008 B with MXFP4 indexer)",
            "NVIDIA Dynamo DeepSeek-V4-Pro recipe: FP8 KV, block 256",
        ),
        allowed_pages=(VLLM_DSV4_BLOCK_TOKENS,),
        default_pages=(VLLM_DSV4_BLOCK_TOKENS,),
        regions=(
            Region("c4a", layers=30, bytes_per_entry=584, tokens_per_entry=4, page_map=PageMap.SCALE,
                   page_align_bytes=VLLM_DSV4_PAGE_ALIGN_BYTES, pack_group="mla",
                   dtype="fp8_ds_mla: 576 B values + 8 B scale footer"),
            Region("c4a-idx", layers=30, bytes_per_entry=indexer_bytes_per_entry, tokens_per_entry=4,
                   page_map=PageMap.SCALE, page_align_bytes=VLLM_DSV4_PAGE_ALIGN_BYTES, pack_group="mla",
                   dtype="lightning-indexer key (132 B: 128 fp8 + 4 B scale; 68 B MXFP4)"),
            Region("c128a", layers=31, bytes_per_entry=584, tokens_per_entry=128, page_map=PageMap.SCALE,
                   page_align_bytes=VLLM_DSV4_PAGE_ALIGN_BYTES, pack_group="mla",
                   dtype="fp8_ds_mla: 576 B values + 8 B scale footer"),
            Region("swa-0", layers=31, bytes_per_entry=584, tokens_per_entry=1, page_map=PageMap.FIXED,
                   fixed_page_tokens=VLLM_DSV4_SWA_BLOCK_TOKENS, window_tokens=128,
                   page_align_bytes=VLLM_DSV4_PAGE_ALIGN_BYTES, pack_group="swa-0",
                   dtype="fp8_ds_mla sliding window, tuple-group 0 (layers[0::2])"),
            Region("swa-1", layers=30, bytes_per_entry=584, tokens_per_entry=1, page_map=PageMap.FIXED,
                   fixed_page_tokens=VLLM_DSV4_SWA_BLOCK_TOKENS, window_tokens=128,
                   page_align_bytes=VLLM_DSV4_PAGE_ALIGN_BYTES, pack_group="swa-1",
                   dtype="fp8_ds_mla sliding window, tuple-group 1 (layers[1::2])"),
        ),
    )


KV_DSV4_VLLM = dsv4_vllm_workload()

#: DeepSeek-V3-class MLA cache: 61 layers x 576 B per token (512 latent + 64 RoPE at 1 B).
KV_MLA = Workload(
    name="kv-mla",
    description=("DeepSeek-V3-class MLA: 61 layers x 576 B per token (kv_lora_rank 512 + RoPE 64, fp8), "
                 "one descriptor per (layer, page)."),
    sources=(
        "DeepSeek-V3 config: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64",
        "CollectiveX kv-transfer suite, earlier kv-mla preset (61 x 576), InferenceX PR #2510 commit log",
    ),
    regions=(
        Region("latent", layers=61, bytes_per_entry=576, tokens_per_entry=1, page_map=PageMap.SCALE,
               dtype="fp8 latent 512 + RoPE 64"),
    ),
)

#: Qwen3-235B-class GQA cache: 94 layers x (K and V) x 4 KV heads x 128 x bf16.
KV_GQA = Workload(
    name="kv-gqa",
    description=("Qwen3-235B-class GQA: 94 layers, K and V each 4 KV heads x 128 dims x bf16 = 1,024 B per "
                 "token; K and V are separate regions (one descriptor per (K|V, layer, page))."),
    sources=(
        "Qwen3-235B-A22B config: num_hidden_layers 94, num_key_value_heads 4, head_dim 128, bf16",
        "vllm-project/vllm nixl_connector.py: K and V of a layer are transferred as separate regions "
        "(num_regions *= 2 for blocks-first layouts)",
        "CollectiveX kv-transfer suite, earlier kv-gqa preset (94 x 1024 elements), InferenceX PR #2510",
    ),
    regions=(
        Region("k", layers=94, bytes_per_entry=4 * 128 * 2, tokens_per_entry=1, page_map=PageMap.SCALE,
               dtype="bf16 keys, 4 heads x 128"),
        Region("v", layers=94, bytes_per_entry=4 * 128 * 2, tokens_per_entry=1, page_map=PageMap.SCALE,
               dtype="bf16 values, 4 heads x 128"),
    ),
)

#: Known presets, by name.
WORKLOADS: dict[str, Workload] = {w.name: w for w in (KV_DSV4, KV_DSV4_VLLM, KV_MLA, KV_GQA)}


def workload_names() -> list[str]:
    return list(WORKLOADS)


def get_workload(name: str | Workload) -> Workload:
    """The preset called ``name`` (a :class:`Workload` passes through)."""
    if isinstance(name, Workload):
        return name
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise BadInput(f"unknown KV workload {name!r}; known: {', '.join(WORKLOADS)}") from None
