"""Sampling without a sort: the Gumbel-max form of ``kernels/sampling.py``'s race, with top-k, top-p and
min-p, in two kernels.

The sampler draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` from a counter-based hash of (row key,
token id). Since ``probs = softmax(logits / T)``, that is ``argmax(logits / T - log E)``: no softmax, no
[B, V] probabilities. ``_race_kernel`` streams parts of each row (about two programs per SM in all), computes
the same splitmix64 hash as ``kernels.sampling.exponential_noise`` (uint64 arithmetic), and reports each
part's maximum, its race winner (the first index wins a tie) and, for top-k, its first-digit counts; for
min-p and the filters it also keeps every token's race score. ``_sample_kernel``, one program per row,
combines the parts and runs the filters' later passes on the kept scores. What a part reports is exact, so
the tokens do not depend on how a row was split, nor on the batch. A row with temperature alone takes the
one hashing pass.

Top-k, top-p and min-p each keep an upper set of the row's logits (every token at or above some value),
so the tokens kept are ``{l >= tau}`` for one threshold, and the winner of the race over them is found
without sorting:

- **Top-k** is a radix select of the k-th largest logit on order-preserving 32-bit keys of the floats:
  a 5-bit digit per pass, a histogram of the digit among the keys that match the digits chosen so far,
  and the bin where the count from the top reaches k. It stops as soon as every key of that bin is among
  the top k (a bin of one key, say): then the bin's lower edge is the threshold. The first digit shares
  the race's pass; the second digit's pass keeps the keys of the first digit's bin, and each later pass
  reads only those still matching. Tokens tied with the k-th logit are kept, as in the torch path.
- **Small top-k** (at most ``CANDIDATE_SLOTS``, 64): each hashing chunk also stores the few tokens that can
  be in the row's top k, and the row's program runs the select and the rejection below on those, in
  registers, instead of passes over the row (a chunk whose ties at its k-th logit fill its slots sends
  the row to the passes). The two ways decide top-p alike: the candidates sum masses in fixed point,
  exact in any order, and the passes retake the test on fixed-point sums wherever their float sums leave
  it in doubt, so neither the way nor the split changes a token.
- **Top-p** (applied after top-k, to the top-k set's renormalised probabilities) is a rejection: the race
  winner ``w`` among the tokens still allowed is kept iff the mass of the tokens strictly above it is
  below ``top_p`` of the top-k set's mass. If it is kept, it is the winner among the kept tokens, because
  they are a subset of those it beat. If not, no token at or below it is kept, so the next pass races the
  tokens above it, and checks the new winner in the same pass that finds the next one. The expected number
  of passes is small: the first winner is kept with probability about ``top_p``.
- **Min-p** keeps ``p >= min_p * p_max``, i.e. ``(l - l_max) / T >= log(min_p)``: a mask once the row's
  maximum is known (a winner of the first pass that fails it is replaced, like a rejected one).

The result equals the torch path's (sort, cumulative sum, race) except at float rounding: the cumulative
mass here is summed in another order, and the torch path scales the logits before sorting, so two logits
that round to the same scaled value tie there and not here. At batch 64 on a 128k vocabulary the torch
path's sort costs about 2.3 ms per step on an H200 (``benchmarks/sampler_bench.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_device import sm_count

# The top-k select's digit: 5 bits of the ordered keys per histogram pass. Triton's histogram costs each
# thread about (bins / 32) * log2(bins) operations per element, so 32 bins make the cheapest pass; with
# 2048 bins (three passes) top-k 50 took 1.84 ms of device time at batch 1 on an H200, 0.29-0.51 ms with
# 32 (docs/performance.md, "Eighth run").
RADIX_BITS: tl.constexpr = tl.constexpr(5)
RADIX_BINS: tl.constexpr = tl.constexpr(32)
# A part's integers in ``_race_kernel``'s output: its winner's token id, then its first-digit counts.
PART_INTS: tl.constexpr = tl.constexpr(1 + 32)


@triton.jit
def _ordered_key(x):
    """float32 -> uint32 with the floats' order (negative floats have their bits flipped)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _race_score(logit, ids, seed, inv_t):
    """``logit / T - log(E)`` with ``E`` from the splitmix64 hash of (row seed, token id)."""
    z = seed + ids.to(tl.uint64) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return logit * inv_t - tl.log(-tl.log(u))


@triton.jit
def _mass(logit, row_max, inv_t):
    """A token's probability relative to the row's most likely token, ``exp((logit - max) / T)``."""
    return tl.exp((logit - row_max) * inv_t)


@triton.jit
def _fixed(mass):
    """``mass`` in fixed point (units of 2**-40): integer sums of it are exact in any order."""
    return (mass * 1099511627776.0).to(tl.int64)


@triton.jit
def _within_top_p(mass_above, top_p, mass_top_k):
    """Top-p's test of a token, on exact (fixed-point) sums: whether the mass strictly above it is below
    ``top_p`` of the top-k set's. Both ways of drawing a row decide by it, so they agree exactly."""
    return mass_above.to(tl.float64) < mass_top_k.to(tl.float64) * top_p


@triton.jit
def _exact_masses(base, vocab, offs, w_key, top_k_key, row_max, inv_t, BLOCK_V: tl.constexpr):
    """One pass over the row for the fixed-point mass above ``w_key`` and of the top-k set (keys at or
    above ``top_k_key``). Run only where float sums leave top-p's test in doubt."""
    lane_above = tl.zeros([BLOCK_V], tl.int64)
    lane_top_k = tl.zeros([BLOCK_V], tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        ids = v0 + offs
        logit = tl.load(base + ids, mask=ids < vocab, other=float("-inf"))
        key = _ordered_key(logit)
        e = _fixed(_mass(logit, row_max, inv_t))
        lane_above += tl.where((ids < vocab) & (key > w_key), e, 0)
        lane_top_k += tl.where((ids < vocab) & (key >= top_k_key), e, 0)
    return tl.sum(lane_above, axis=0), tl.sum(lane_top_k, axis=0)


@triton.jit
def _lane_best(lane_score, lane_index, score, ids):
    """Each lane's running race winner: the higher score, the earlier token on a tie."""
    better = score > lane_score
    return tl.where(better, score, lane_score), tl.where(better, ids, lane_index)


@triton.jit
def _first_best(lane_score, lane_index):
    """The best score across lanes, and the smallest token id holding it (torch.argmax's tie rule)."""
    best = tl.max(lane_score, axis=0)
    return best, tl.min(tl.where(lane_score == best, lane_index, 2147483647), axis=0)


@triton.jit
def _select_bin(hist, k):
    """The bin holding the k-th largest of the counted keys, how many counted keys lie above it, and how
    many are in it."""
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # keys in higher bins
    b = tl.sum((above + hist >= k).to(tl.int32), axis=0) - 1
    chosen = tl.arange(0, RADIX_BINS) == b
    return b, tl.sum(tl.where(chosen, above, 0), axis=0), tl.sum(tl.where(chosen, hist, 0), axis=0)


@triton.jit
def _tile_kth_key(key, valid, k):
    """The top-k select over a tile held in registers: the lowest key of the ``k`` largest keys where
    ``valid`` (0 where there are no more than ``k``), or the lower edge of its radix bin once every key of
    that bin is among the top ``k``: the keys at or above it are the top ``k``, with any ties at the k-th."""
    lo = tl.zeros([], tl.uint32)
    if tl.sum(valid.to(tl.int32), axis=0) > k:
        hist = tl.histogram((key >> (32 - RADIX_BITS)).to(tl.int32), RADIX_BINS, mask=valid)
        b, above, count = _select_bin(hist, k)
        prefix = b.to(tl.uint32)
        k_rem = k - above
        hi = 32 - RADIX_BITS
        while (hi > 0) & (count > k_rem):
            shift = tl.maximum(hi - RADIX_BITS, 0)
            digit_mask = ((1 << (hi - shift)) - 1).to(tl.uint32)
            match = valid & ((key >> hi) == prefix)
            hist = tl.histogram(((key >> shift) & digit_mask).to(tl.int32), RADIX_BINS, mask=match)
            prefix, k_rem, count, hi = _radix_step(hist, prefix, k_rem, hi, shift)
        lo = prefix << hi
    return lo


@triton.jit
def _small_top_k(top_k, vocab, SLOTS: tl.constexpr):
    """Whether a row's top-k is on and at most SLOTS: its chunks keep their top k, and it is drawn from them."""
    return (top_k <= SLOTS) & (top_k < vocab)


@triton.jit
def _chunk_ahead(base, ids, ahead, limit, BLOCK_V: tl.constexpr, other):
    """The chunk ``ahead`` chunks after ``ids`` (``other`` past ``limit``). A pass is a loop over chunks
    that Triton does not pipeline, so each loop loads the next chunk (the top-p passes: the next two)
    while it processes one: without that a program waited for every chunk (~1 us from L2, 37 times over a
    151,936-token row)."""
    return tl.load(base + ids + ahead * BLOCK_V, mask=ids + ahead * BLOCK_V < limit, other=other)


@triton.jit
def _radix_step(hist, prefix, k_rem, hi, shift):
    """The select's state after one digit (bits ``shift`` to ``hi``) counted in ``hist``: the prefix
    extended by the digit holding the ``k_rem``-th largest key, that key's rank among the keys of the
    digit, the keys in the digit, and the bit the new prefix starts at."""
    b, above, count = _select_bin(hist, k_rem)
    return (prefix << (hi - shift)) | b.to(tl.uint32), k_rem - above, count, shift


@triton.jit
def _first_radix_pass(base, vocab, offs, prefix, k_rem, hi, kept_ptr, BLOCK_V: tl.constexpr):
    """The top-k select's second digit, over the row's logits: the keys whose bits from ``hi`` up are
    ``prefix`` (the first digit's bin) are counted by their next ``RADIX_BITS`` bits, and kept, lane by
    lane (lane j's i-th key at ``kept[i * BLOCK_V + j]``, no scan needed), since only they can match a
    later digit's prefix. Returns the select's state and each lane's count of kept keys."""
    shift = tl.maximum(hi - RADIX_BITS, 0)
    digit_mask = ((1 << (hi - shift)) - 1).to(tl.uint32)
    hist = tl.zeros([RADIX_BINS], tl.int32)
    lane_kept = tl.zeros([BLOCK_V], tl.int32)
    logit = tl.load(base + offs, mask=offs < vocab, other=0.0)
    for v0 in range(0, vocab, BLOCK_V):
        ids = v0 + offs
        key = _ordered_key(logit)
        logit = _chunk_ahead(base, ids, 1, vocab, BLOCK_V, 0.0)
        match = (ids < vocab) & ((key >> hi) == prefix)
        tl.store(kept_ptr + lane_kept * BLOCK_V + offs, key.to(tl.int32, bitcast=True), mask=match)
        lane_kept += match.to(tl.int32)
        hist += tl.histogram(((key >> shift) & digit_mask).to(tl.int32), RADIX_BINS, mask=match)
    prefix, k_rem, count, hi = _radix_step(hist, prefix, k_rem, hi, shift)
    return prefix, k_rem, count, hi, lane_kept


@triton.jit
def _kept_radix_pass(kept_ptr, lane_kept, rows, offs, prefix, k_rem, hi, BLOCK_V: tl.constexpr):
    """One later digit of the top-k select, over the keys kept (``rows`` rows of lanes): the same counts as
    a pass over the whole row, from a fraction of its reads. The keys it counts (those matching ``prefix``)
    are kept again in place, lane by lane (a lane's i-th match goes to a row it has read, i <= r), so
    each pass reads only the keys of the digit before its own. Returns the select's state, each lane's
    count of keys now kept, and their rows."""
    shift = tl.maximum(hi - RADIX_BITS, 0)
    digit_mask = ((1 << (hi - shift)) - 1).to(tl.uint32)
    hist = tl.zeros([RADIX_BINS], tl.int32)
    lane_now = tl.zeros([BLOCK_V], tl.int32)
    key = tl.load(kept_ptr + offs, mask=lane_kept > 0, other=0)
    for r in range(0, rows):
        following = tl.load(kept_ptr + (r + 1) * BLOCK_V + offs, mask=lane_kept > r + 1, other=0)
        bits = key.to(tl.uint32, bitcast=True)
        match = (lane_kept > r) & ((bits >> hi) == prefix)
        hist += tl.histogram(((bits >> shift) & digit_mask).to(tl.int32), RADIX_BINS, mask=match)
        tl.store(kept_ptr + lane_now * BLOCK_V + offs, key, mask=match)
        lane_now += match.to(tl.int32)
        key = following
    prefix, k_rem, count, hi = _radix_step(hist, prefix, k_rem, hi, shift)
    return prefix, k_rem, count, hi, lane_now, tl.max(lane_now, axis=0)


@triton.jit(do_not_specialize=["chunk", "num_parts"])
def _race_kernel(
    logits_ptr,
    inv_temp_ptr,
    keys_ptr,
    top_k_ptr,
    scores_ptr,
    part_f_ptr,
    part_i_ptr,
    cand_f_ptr,
    cand_i_ptr,
    vocab,
    stride_row,
    chunk,
    num_parts,
    num_chunks,
    FILTERED: tl.constexpr,
    CACHE: tl.constexpr,
    CANDIDATES: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Pass 1 over one part of a row, ``chunk`` tokens from ``part * chunk``: the part's maximum, its race
    winner (score, then the smallest token id holding it), and where the row has top-k, the count of each
    first digit of the ordered keys. With CACHE each token's race score goes to ``scores`` [B, V], so the
    row's later passes (``_sample_kernel``) read it instead of hashing again. With CANDIDATES, a row
    whose top-k is at most SLOTS also reports, for each chunk, the tokens that can be in the row's top k
    (its logit, race score and id, at most SLOTS of them, and how many there are). What a part reports is exact (a maximum, an argmax, integer counts, tokens), so the row's results do
    not depend on how it was split."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    inv_t = tl.load(inv_temp_ptr + row)
    seed = tl.load(keys_ptr + row).to(tl.uint64) * 0x9E3779B97F4A7C15
    offs = tl.arange(0, BLOCK_V)
    count_digits = False
    candidates = False
    top_k = vocab
    if FILTERED:
        top_k = tl.load(top_k_ptr + row)
        count_digits = top_k < vocab
        if CANDIDATES:
            candidates = _small_top_k(top_k, vocab, SLOTS)
    running = tl.zeros([], tl.uint32)
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    # Reductions across lanes wait for the end of the part: one per part, not one per chunk.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    hist = tl.zeros([RADIX_BINS], tl.int32)
    lane_score = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_index = tl.zeros([BLOCK_V], tl.int32)
    logit = tl.load(base + start + offs, mask=start + offs < end, other=float("-inf"))
    for v0 in range(start, end, BLOCK_V):
        ids = v0 + offs
        valid = ids < end
        m = tl.maximum(m, logit)
        score = tl.where(valid, _race_score(logit, ids, seed, inv_t), float("-inf"))
        if CACHE:
            tl.store(scores_ptr + row.to(tl.int64) * vocab + ids, score, mask=valid)
        lane_score, lane_index = _lane_best(lane_score, lane_index, score, ids)
        if FILTERED:  # noqa: SIM102 (a constexpr branch, then a runtime one)
            if count_digits:
                digit = _ordered_key(logit) >> (32 - RADIX_BITS)
                hist += tl.histogram(digit.to(tl.int32), RADIX_BINS, mask=valid)
            if CANDIDATES:  # noqa: SIM102
                if candidates:
                    # Only tokens at or above the part's running threshold can be in the row's top k: it
                    # is the k-th largest of some of the row's tokens. A chunk with more than SLOTS of them
                    # keeps its own top k of them and raises the threshold to its k-th largest.
                    key = _ordered_key(logit)
                    kept = valid & (key >= running)
                    num_kept = tl.sum(kept.to(tl.int32), axis=0)
                    if num_kept > SLOTS:
                        running = _tile_kth_key(key, kept, top_k)
                        kept = kept & (key >= running)
                        num_kept = tl.sum(kept.to(tl.int32), axis=0)  # above SLOTS only with ties at the k-th
                    at = tl.cumsum(kept.to(tl.int32), axis=0) - 1
                    cell = row.to(tl.int64) * num_chunks + v0 // BLOCK_V
                    kept_slots = kept & (at < SLOTS)
                    tl.store(cand_f_ptr + (cell * SLOTS + at) * 2, logit, mask=kept_slots)
                    tl.store(cand_f_ptr + (cell * SLOTS + at) * 2 + 1, score, mask=kept_slots)
                    tl.store(cand_i_ptr + cell * (SLOTS + 1) + 1 + at, ids, mask=kept_slots)
                    tl.store(cand_i_ptr + cell * (SLOTS + 1), num_kept)
        logit = _chunk_ahead(base, ids, 1, end, BLOCK_V, float("-inf"))
    best, best_index = _first_best(lane_score, lane_index)
    slot = row.to(tl.int64) * num_parts + part
    tl.store(part_f_ptr + slot * 2, tl.max(m, axis=0))
    tl.store(part_f_ptr + slot * 2 + 1, best)
    ints = part_i_ptr + slot * PART_INTS
    tl.store(ints, best_index)
    if FILTERED:  # noqa: SIM102
        if count_digits:
            tl.store(ints + 1 + tl.arange(0, RADIX_BINS), hist)


@triton.jit(do_not_specialize=["stride_kept", "num_parts"])
def _sample_kernel(
    logits_ptr,
    inv_temp_ptr,
    keys_ptr,
    log_min_p_ptr,
    top_k_ptr,
    top_p_ptr,
    scores_ptr,
    part_f_ptr,
    part_i_ptr,
    cand_f_ptr,
    cand_i_ptr,
    kept_ptr,
    out_ptr,
    vocab,
    stride_row,
    stride_kept,
    num_parts,
    num_chunks,
    HAS_MIN_P: tl.constexpr,
    FILTERED: tl.constexpr,
    CACHED: tl.constexpr,
    CANDIDATES: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """The rest of a row after ``_race_kernel``'s parts: their results combined, then the top-k select's
    later digits and the top-p / min-p rejection passes, one program per row. With CACHED (set where the
    parts cached the scores: min-p or the filters) a pass reads the race scores instead of hashing again.
    With CANDIDATES, a row whose chunks reported their top k (``_race_kernel``) runs all of that on those
    few tokens in registers instead (``_sample_candidates``); the passes remain for the others."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    inv_t = tl.load(inv_temp_ptr + row)
    seed = tl.load(keys_ptr + row).to(tl.uint64) * 0x9E3779B97F4A7C15
    row_scores = scores_ptr + row.to(tl.int64) * vocab
    offs = tl.arange(0, BLOCK_V)
    log_min_p = float("-inf")
    if HAS_MIN_P:
        log_min_p = tl.load(log_min_p_ptr + row)
    top_k = vocab
    top_p = 1.0
    if FILTERED:  # top-k (the vocabulary size where off) and top-p (1 where off)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)

    # Pass 1's results from the parts: the row's maximum, the race's winner (the first token holding the
    # best score: each part reports its first), and the counts of the top-k select's first digit.
    parts = tl.arange(0, BLOCK_P)
    in_row = parts < num_parts
    slots = row.to(tl.int64) * num_parts + parts
    row_max = tl.max(tl.load(part_f_ptr + slots * 2, mask=in_row, other=float("-inf")), axis=0)
    part_best = tl.load(part_f_ptr + slots * 2 + 1, mask=in_row, other=float("-inf"))
    part_index = tl.load(part_i_ptr + slots * PART_INTS, mask=in_row, other=2147483647)
    _, best_index = _first_best(part_best, part_index)

    if CANDIDATES:
        use_candidates = _small_top_k(top_k, vocab, SLOTS)
        if use_candidates:
            cells = tl.arange(0, BLOCK_C)
            cell_counts = cand_i_ptr + (row.to(tl.int64) * num_chunks + cells) * (SLOTS + 1)
            counts = tl.load(cell_counts, mask=cells < num_chunks, other=0)
            use_candidates = tl.max(counts, axis=0) <= SLOTS  # else ties at a chunk's k-th overflowed it
            if use_candidates:
                best_index = _sample_candidates(
                    cand_f_ptr, cand_i_ptr, row, num_chunks, counts, row_max, inv_t, log_min_p, top_k, top_p,
                    SLOTS, BLOCK_C,
                )  # fmt: skip
        if not use_candidates:
            best_index = _sample_passes(
                base, row, row_scores, kept_ptr, part_i_ptr, slots, in_row, best_index, row_max, inv_t, seed,
                log_min_p, top_k, top_p, vocab, stride_kept, offs, FILTERED, CACHED, BLOCK_V,
            )  # fmt: skip
    else:
        best_index = _sample_passes(
            base, row, row_scores, kept_ptr, part_i_ptr, slots, in_row, best_index, row_max, inv_t, seed,
            log_min_p, top_k, top_p, vocab, stride_kept, offs, FILTERED, CACHED, BLOCK_V,
        )  # fmt: skip
    tl.store(out_ptr + row, best_index)


@triton.jit
def _sample_candidates(
    cand_f_ptr,
    cand_i_ptr,
    row,
    num_chunks,
    counts,
    row_max,
    inv_t,
    log_min_p,
    top_k,
    top_p,
    SLOTS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The row's draw from its chunks' top-k tokens (``counts`` per chunk), in registers: they hold every
    token at or above the row's k-th largest logit, so the select, the top-k set's mass, the mass above a
    token of that set and the race among it are those of the whole row. The same rejection as the passes
    of ``_sample_passes``, on a tile of ``BLOCK_C * SLOTS`` tokens instead of the vocabulary."""
    cells = tl.arange(0, BLOCK_C)
    at = tl.arange(0, SLOTS)
    cell = row.to(tl.int64) * num_chunks + cells
    held = tl.reshape(at[None, :] < counts[:, None], [BLOCK_C * SLOTS])
    flat = tl.reshape((cell * SLOTS)[:, None] + at[None, :], [BLOCK_C * SLOTS])
    logit = tl.load(cand_f_ptr + flat * 2, mask=held, other=float("-inf"))
    score = tl.load(cand_f_ptr + flat * 2 + 1, mask=held, other=float("-inf"))
    ids = tl.load(
        cand_i_ptr + tl.reshape((cell * (SLOTS + 1) + 1)[:, None] + at[None, :], [BLOCK_C * SLOTS]),
        mask=held,
        other=2147483647,
    )
    key = _ordered_key(logit)
    lo = _tile_kth_key(key, held, top_k)
    in_top_k = held & (key >= lo)
    e = _fixed(_mass(logit, row_max, inv_t))
    mass_top_k = tl.sum(tl.where(in_top_k, e, 0), axis=0)
    allowed = in_top_k & ((logit - row_max) * inv_t >= log_min_p)
    _, best_index = _first_best(tl.where(allowed, score, float("-inf")), ids)
    w_key = tl.max(tl.where(ids == best_index, key, 0), axis=0)
    done = top_p >= 1.0
    while not done:
        above = held & (key > w_key)
        mass_above = tl.sum(tl.where(above, e, 0), axis=0)
        next_score, next_index = _first_best(tl.where(allowed & above, score, float("-inf")), ids)
        done = _within_top_p(mass_above, top_p, mass_top_k) | (next_score == float("-inf"))
        best_index = tl.where(done, best_index, next_index)
        w_key = tl.max(tl.where(ids == best_index, key, 0), axis=0)
    return best_index


@triton.jit
def _sample_passes(
    base,
    row,
    row_scores,
    kept_ptr,
    part_i_ptr,
    slots,
    in_row,
    best_index,
    row_max,
    inv_t,
    seed,
    log_min_p,
    top_k,
    top_p,
    vocab,
    stride_kept,
    offs,
    FILTERED: tl.constexpr,
    CACHED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The row's draw by passes over its logits: the top-k select's later digits, then the rejection
    passes, each reading the kept race scores (CACHED) or hashing again."""
    # Top-k: the rest of the radix select. ``lo`` becomes the lowest key kept (0: every token): the k-th
    # largest key, or the lower edge of its digit once every key of that digit is among the top k.
    lo = tl.zeros([], tl.uint32)
    if FILTERED:  # noqa: SIM102
        if top_k < vocab:
            bins = tl.arange(0, RADIX_BINS)
            counts = tl.load(
                part_i_ptr + slots[:, None] * PART_INTS + 1 + bins[None, :], mask=in_row[:, None], other=0
            )
            b, above, count = _select_bin(tl.sum(counts, axis=0), top_k)
            k_rem = top_k - above
            prefix = b.to(tl.uint32)
            hi = 32 - RADIX_BITS
            if count > k_rem:
                row_kept = kept_ptr + row.to(tl.int64) * stride_kept
                prefix, k_rem, count, hi, lane_kept = _first_radix_pass(
                    base, vocab, offs, prefix, k_rem, hi, row_kept, BLOCK_V
                )
                rows = tl.max(lane_kept, axis=0)
                while (hi > 0) & (count > k_rem):
                    prefix, k_rem, count, hi, lane_kept, rows = _kept_radix_pass(
                        row_kept, lane_kept, rows, offs, prefix, k_rem, hi, BLOCK_V
                    )
            lo = prefix << hi
    top_k_key = lo

    # The candidate: the race's winner so far, while it is among the tokens allowed. Then, while the
    # candidate needs checking (top-p) or was not allowed, one pass: the mass above it, the top-k set's
    # mass, and the winner among the allowed tokens above it (or among all allowed ones).
    w_logit = tl.load(base + best_index)
    w_key = _ordered_key(w_logit)
    allowed = (w_key >= lo) & ((w_logit - row_max) * inv_t >= log_min_p)
    check_p = top_p < 1.0
    done = allowed & (not check_p)
    while not done:
        lane_above = tl.zeros([BLOCK_V], tl.float32)
        lane_top_k = tl.zeros([BLOCK_V], tl.float32)
        lane_score = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_index = tl.zeros([BLOCK_V], tl.int32)
        logit = tl.load(base + offs, mask=offs < vocab, other=float("-inf"))
        after = _chunk_ahead(base, offs, 1, vocab, BLOCK_V, float("-inf"))
        for v0 in range(0, vocab, BLOCK_V):
            ids = v0 + offs
            valid = ids < vocab
            key = _ordered_key(logit)
            above_w = valid & (key > w_key)
            if FILTERED:
                e = _mass(logit, row_max, inv_t)
                lane_above += tl.where(above_w, e, 0.0)
                lane_top_k += tl.where(valid & (key >= top_k_key), e, 0.0)
            racing = (
                valid & (key >= lo) & ((logit - row_max) * inv_t >= log_min_p) & (above_w | (not allowed))
            )
            if CACHED:
                score = tl.load(row_scores + ids, mask=racing, other=float("-inf"))
            else:  # only a row whose logits are all -inf gets here: nothing races
                score = tl.where(racing, _race_score(logit, ids, seed, inv_t), float("-inf"))
            lane_score, lane_index = _lane_best(lane_score, lane_index, score, ids)
            logit, after = after, _chunk_ahead(base, ids, 2, vocab, BLOCK_V, float("-inf"))
        mass_above = tl.sum(lane_above, axis=0)
        mass_top_k = tl.sum(lane_top_k, axis=0)
        next_score, next_index = _first_best(lane_score, lane_index)
        # Float sums of ~40 terms a lane, then a tree: within 2**-17 of the exact sum, far inside the margin
        # of 2**-16 of the top-k mass (at least 1) below which the test is taken again on exact sums.
        within = mass_above < top_p * mass_top_k
        if FILTERED:  # noqa: SIM102
            if (
                check_p
                & allowed
                & (tl.abs(mass_above - top_p * mass_top_k) <= mass_top_k * 0.0000152587890625)
            ):
                exact_above, exact_top_k = _exact_masses(
                    base, vocab, offs, w_key, top_k_key, row_max, inv_t, BLOCK_V
                )
                within = _within_top_p(exact_above, top_p, exact_top_k)
        keep = allowed & ((not check_p) | within | (next_score == float("-inf")))
        done = keep | ((not allowed) & (not check_p))
        lo = tl.where(allowed & (not keep), w_key + 1, lo)
        best_index = tl.where(keep, best_index, next_index)
        w_key = _ordered_key(tl.load(base + best_index))
        allowed = True
    return best_index


# Chunk width and warps of ``_sample_kernel``'s passes on a GPU (one program per row; the interpreter takes
# 64 and 1). Its passes no longer hash (they read the kept scores), and with the next chunks' loads in
# flight 16 warps beat 8 at batches 1-64 (top-p 0.9: 47.5 against 59.3 us at batch 1; 4096 x 16 was the
# best of five shapes, docs/performance.md, fifteenth run).
CUDA_BLOCK_V = 4096
CUDA_NUM_WARPS = 16
# ``_race_kernel``'s parts: the hashing pass is split until the batch has about two programs per SM, a
# part being a whole number of RACE_BLOCK_V chunks, at most MAX_PARTS per row (``_sample_kernel`` reads a
# row's parts in one tile). The interpreter: chunks of 64, up to 8 parts.
RACE_BLOCK_V = 4096
RACE_NUM_WARPS = 8
MAX_PARTS = 256
# Rows with top-k at most CANDIDATE_SLOTS: each hashing chunk keeps its own top k (at most this many
# tokens, else the row takes the passes), and the row's program draws from those, in one tile of at most
# MAX_CANDIDATE_CHUNKS x CANDIDATE_SLOTS tokens (a vocabulary of up to 262,144 on a GPU). The interpreter:
# 16 slots, up to 8 chunks of 64.
CANDIDATE_SLOTS = 64
MAX_CANDIDATE_CHUNKS = 64


def race_parts(batch: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(tokens per part, parts per row) of the hashing pass for a batch: about two programs per SM on a
    GPU (eight in all on the CPU), at most ``MAX_PARTS`` (8 on the CPU) per row, whole chunks each."""
    block, most, slots = (
        (RACE_BLOCK_V, MAX_PARTS, 2 * sm_count(device)) if device.type == "cuda" else (64, 8, 8)
    )
    want = max(1, min(most, slots // batch))
    chunk = triton.cdiv(triton.cdiv(vocab, want), block) * block
    return chunk, triton.cdiv(vocab, chunk)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was
    imported), which takes CPU tensors; compiled, it takes GPU tensors only."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sample_kernel, InterpretedFunction)


def gumbel_sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    row_keys: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    *,
    smallest_top_k: int | None = None,
    chunk: int | None = None,
    candidates: bool = True,
) -> torch.Tensor:
    """logits [B, V] fp32 (last dim contiguous); temperatures [B] > 0; row_keys [B] int64 (the sampler's
    per-row keys); min_p [B] in [0, 1] or None; top_k [B] (any dtype holding integers; the vocabulary size
    where off) or None; top_p [B] in (0, 1] (1 where off) or None. Returns the sampled token ids, [B]
    int64. ``chunk`` (tests): tokens per part of the hashing pass, a multiple of its chunk width, instead
    of ``race_parts``'s; the tokens drawn do not depend on it. ``candidates=False`` (tests): every row takes the
    passes, as a row with a larger top-k does. ``smallest_top_k`` (the sampler's, from the host): the
    smallest top-k of the rows; above ``CANDIDATE_SLOTS`` no row takes the chunks' top k, so the batch
    takes the variant without them, whose hashing pass is lighter. None of the three changes a token."""
    batch, vocab = logits.shape
    device = logits.device
    out = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    inv_temp = (1.0 / temperatures.to(torch.float32)).contiguous()
    log_min_p = torch.log(min_p.to(torch.float32)).contiguous() if min_p is not None else inv_temp
    filtered = top_k is not None or top_p is not None
    selects = top_k is not None  # the top-k select may run: it keeps keys in a [B, V] scratch
    if filtered:
        top_k = torch.full_like(inv_temp, vocab) if top_k is None else top_k
        top_p = torch.ones_like(inv_temp) if top_p is None else top_p
        # New tensors, never views of the sampler's [B, 4] row values: a batch of one would pass its
        # view as it is, 8 bytes off a 16-byte boundary, and compile another variant for the same call.
        top_k = top_k.to(torch.int32).clamp(1, vocab)
        top_p = top_p.to(torch.float32).clamp(max=1.0)
    on_gpu = logits.is_cuda
    if chunk is None:
        chunk, parts = race_parts(batch, vocab, device)
    else:
        parts = triton.cdiv(vocab, chunk)
        assert chunk % (RACE_BLOCK_V if on_gpu else 64) == 0 and parts <= (MAX_PARTS if on_gpu else 8)
    # Later passes run only for min-p and the filters: only then are the race scores kept for them.
    cached = filtered or min_p is not None
    scores = torch.empty(batch, vocab, device=device) if cached else logits
    part_f = torch.empty(batch, parts, 2, device=device)
    part_i = torch.empty(batch, parts, PART_INTS, dtype=torch.int32, device=device)
    block = CUDA_BLOCK_V if on_gpu else 64
    kept = (
        torch.empty(batch, triton.cdiv(vocab, block) * block, dtype=torch.int32, device=device)
        if selects
        else part_i
    )
    # Each hashing chunk's top k, for rows with a small top-k: the variant of a batch with such a row (its
    # other rows skip it at run time); a batch with top-p alone, or only larger top-k, runs without it.
    race_block = RACE_BLOCK_V if on_gpu else 64
    num_chunks = triton.cdiv(vocab, race_block)
    slots = CANDIDATE_SLOTS if on_gpu else 16
    candidates = candidates and selects and num_chunks <= (MAX_CANDIDATE_CHUNKS if on_gpu else 8)
    candidates = candidates and (smallest_top_k is None or smallest_top_k <= slots)
    cand_cells = batch * num_chunks if candidates else 1
    cand_f = torch.empty(cand_cells, slots, 2, device=device)
    cand_i = torch.empty(cand_cells, slots + 1, dtype=torch.int32, device=device)
    keys = row_keys.contiguous()
    top_k_arg = top_k if filtered else inv_temp
    _race_kernel[(batch, parts)](
        logits, inv_temp, keys, top_k_arg, scores, part_f, part_i, cand_f, cand_i, vocab, logits.stride(0),
        chunk, parts, num_chunks,
        FILTERED=filtered, CACHE=cached, CANDIDATES=candidates, SLOTS=slots, BLOCK_V=race_block,
        num_warps=RACE_NUM_WARPS if on_gpu else 1,
    )  # fmt: skip
    _sample_kernel[(batch,)](
        logits, inv_temp, keys, log_min_p, top_k_arg, top_p if filtered else inv_temp, scores, part_f,
        part_i, cand_f, cand_i, kept, out, vocab, logits.stride(0), kept.stride(0), parts, num_chunks,
        HAS_MIN_P=min_p is not None, FILTERED=filtered, CACHED=cached, CANDIDATES=candidates, SLOTS=slots,
        BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_V=block, BLOCK_P=MAX_PARTS if on_gpu else 8,
        num_warps=CUDA_NUM_WARPS if on_gpu else 1,
    )  # fmt: skip
    return out
