"""Robust aggregation of one span's contributions, and the verdict on each contributor.

A reducer of hivemind's all-reduce sees every groupmate's part of its span. Instead of their weighted mean it
takes **CenteredClip** (Karimireddy et al. 2021, as used by BTARD, arXiv 2106.11257): start at the coordinate-wise
median and move towards each contribution by at most a radius `tau` from the current centre, until the centre no
longer moves. A contribution, however large, then shifts the result by at most its weight share times `tau`, and
`tau` is set by the group's own spread (the median distance to the start), so a minority cannot inflate it.
Coordinate-wise medians and trimmed means were not chosen: "A Little Is Enough" (Baruch et al., NeurIPS 2019)
defeats them with a shift of one standard deviation per coordinate, which stays inside every coordinate's range.

Claimed token counts weigh contributions, but none above the group's (high) median claim: one peer claiming 10^12
tokens weighs as much as a typical peer, not more.

The verdict flags contributions that no honest peer would send, for reputation (peers/reputation.py: two
strikes ban), and leaves out some more that an honest peer may send now and then:
- **opposed** (left out): pointing against most of the others (cosine below `-OPPOSED_COS`), as long as such
  parts are a minority of the group. Peers that train one model move their weights the same way: their updates
  of one span have cosines of 0.27-0.98 with each other (3 peers of e64h4d2w128, 12 rounds of H=50:
  benchmarks/RESULTS.md), while a sign-flipped update of any length has about minus that. A flip too short to
  be far (2-3x an honest update) still moves the clipped result by up to half the clipping radius in a group
  of three, against the others, round after round; leaving it out stops that. Checked first: such a part also
  skews the result the far test measures against.
- **flipped** (a strike): opposed to others that clearly agree (their median cosine at least `FLIP_AGREEMENT`),
  by at least `FLIP_SHARE` of their agreement. Where a model has little left to learn from a round, honest
  updates are mostly noise: in a tiny model at 5 inner steps (tests/test_swarm.py's late joiner) honest spans
  of 8192 values had cosines of -0.24 to +0.43 with each other, so an honest part pointing against two others
  happens there. It is only opposed: as strikes, such parts banned honest peers.
- **astray** (left out): further from the result than `FAR_RATIO` times the median distance *and* than its own
  share of the result allows (a peer that trained on more tokens may have moved further). A late joiner a few
  steps into its round sends a small update: it lies near zero, within one result's length, and is never
  flagged. **far** (a strike): as astray, but beyond `FAR_STRIKE_RATIO` times the median distance. Honest parts
  were seen 3.2-5.3x the median distance away in that tiny swarm (a fresh inner optimizer after a download
  takes longer steps); a 90x or -10x update is 10x and more.
- **colluding:** two contributions much closer to each other than peers that train independently ever are
  (independent updates in high dimension are all about equally far apart; a pair that shifts the result
  together, as "A Little Is Enough" does, sends one vector, or two near it), as long as the peers with such a
  twin are a minority of the group (most peers close together and one apart is an honest group with an outlier;
  most peers in close pairs, one whose updates hardly differ). Small contributions (late joiners, near zero and
  so near one another) are never flagged: they cannot shift the result; nor are parts too short to be told
  apart (`COLLUSION_MIN_VALUES`).
- **one-sided** (a strike): above the group's coordinate-wise median in far more of its values than below it (or
  the reverse) once every part is brought to one length, while the rest lean the other way. "A Little Is Enough"
  sends the honest mean minus a standard deviation in every coordinate: each shift is inside the honest range,
  but all point one way. An honest part's deviations have no side, except that a shorter part lies nearer zero
  than the median and so leans against the median's own signs: hence the one length (coded parts are unchanged by
  it but for their scales). Measured on real swarms of 3-4 peers (e8 code, parts of 16384 values): 1419 honest
  parts within +-0.13 (99% within 0.08), a lone attacker's parts 0.10-0.47 (most beyond 0.2, so caught in its
  first or second round; its own last two updates as the honest ones it knows). The deviations' signs cancel
  coordinate by coordinate, so the honest parts of such a group lean the other way: only a minority side is
  flagged, and only when all of it is clearly one-sided. Small parts and short ones are not judged. The sign
  code leaves such an attacker less visible (0.11-0.24 in tests/test_robust.py's synthetic groups, against
  0.29-0.50 for e8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAU_FACTOR = 2.0  # clipping radius: this times the median distance of the contributions to their median
MEDIAN_BLOCK_VALUES = 1 << 18  # coordinate_median sorts blocks of this many values (1 MiB), in cache
CLIP_ITERATIONS = 20  # CenteredClip converges geometrically; 20 steps leave it moving by < 1e-4 of tau here
FAR_RATIO = 3.0  # "astray": beyond this times the median distance to the result (honest distances concentrate)
FAR_STRIKE_RATIO = 8.0  # "far", a strike: beyond this times it (honest parts: up to 5.3x measured)
FAR_TOKEN_ALLOWANCE = 4.0  # a peer with k times the median tokens may lie up to (1 + k) results away, k <= this
OPPOSED_COS = 0.05  # "opposed": a cosine below minus this (honest peers measure +0.27 and more); see _opposed
FLIP_AGREEMENT = 0.5  # "flipped": opposed to others whose median cosine is at least this (noise: up to 0.43) ...
FLIP_SHARE = 0.6  # ... by a cosine below minus this share of it (a sign flip: about minus all of it)
COLLUSION_DISTANCE = 0.25  # "colluding": two contributions closer than this times the median pairwise distance
SMALL_SHARE = 0.5  # a contribution shorter than this times the result is never taken for a colluder
COLLUSION_MIN_VALUES = 256  # shorter parts (less than one block of the codes) are not judged for collusion
ONE_SIDED = 0.2  # "one-sided": (share of values above the median) - (share below), beyond this (honest: <= 0.13)
ONE_SIDED_MIN_VALUES = 16384  # shorter parts are not judged for it (honest ones of 4096 values measured up to 0.2)


@dataclass(frozen=True)
class RobustResult:
    """The aggregate of one span and what it says about each contributor (indices into the inputs)."""

    aggregate: torch.Tensor
    far: frozenset[int]  # a strike
    colluding: frozenset[int]  # a strike
    one_sided: frozenset[int] = frozenset()  # a strike
    opposed: frozenset[int] = frozenset()
    flipped: frozenset[int] = frozenset()  # a strike
    astray: frozenset[int] = frozenset()

    @property
    def flagged(self) -> frozenset[int]:
        """Every part left out of the aggregate."""
        return self.far | self.colluding | self.one_sided | self.opposed | self.flipped | self.astray


def high_median(values: torch.Tensor) -> float:
    """The median, the higher middle value for an even count: of two peers' claims, the larger (one peer's claim
    cannot be weighed against the other's), while a lone high claim among four stays out."""
    return float(values.sort().values[values.numel() // 2])


def capped_weights(tokens: torch.Tensor) -> torch.Tensor:
    """Claimed token counts, each capped at their (high) median; non-finite or negative claims weigh nothing."""
    tokens = torch.where(torch.isfinite(tokens) & (tokens > 0), tokens, torch.zeros_like(tokens))
    return tokens.clamp(max=high_median(tokens))


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """The median of each coordinate over the rows of `parts` (the mean of the middle two for an even count).

    A group has few rows and a part many columns, where torch.sort along the rows is slow (benchmarks/RESULTS.md):
    instead each block of columns, small enough to stay in cache, is sorted by odd-even transposition (n rounds of
    elementwise min/max between neighbouring rows).
    """
    n = parts.shape[0]
    median = torch.empty(parts.shape[1], dtype=parts.dtype)
    for block in _column_blocks(parts):
        rows = parts[:, block].clone()
        for round_number in range(n):
            first = round_number % 2
            lower, upper = rows[first : n - 1 : 2], rows[first + 1 : n : 2]
            rows[first : n - 1 : 2], rows[first + 1 : n : 2] = torch.minimum(lower, upper), torch.maximum(lower, upper)
        torch.add(rows[(n - 1) // 2], rows[n // 2], out=median[block]).div_(2)
    return median


def _column_blocks(parts: torch.Tensor) -> list[slice]:
    """The blocks of columns of `parts` that stay in cache: about MEDIAN_BLOCK_VALUES values each."""
    width = max(1024, MEDIAN_BLOCK_VALUES // parts.shape[0])
    return [slice(begin, begin + width) for begin in range(0, parts.shape[1], width)]


def centered_clip(offsets: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, tau: float) -> torch.Tensor:
    """CenteredClip: the fixed point of v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i, from `start`, where
    `offsets` holds the rows x_i - start.

    The centre stays a combination `start + c @ offsets`, so every iteration works on the n x n Gram matrix of the
    offsets (distances, steps) and the part's values are read twice in all, not three times an iteration.
    """
    share = (weights / weights.sum()).double()
    gram = (offsets @ offsets.T).double()
    coefficients = torch.zeros_like(share)
    for _ in range(CLIP_ITERATIONS):
        towards_centre = gram @ coefficients
        squared = gram.diagonal() - 2 * towards_centre + coefficients @ towards_centre  # |x_i - v|^2
        norms = squared.clamp(min=0).sqrt()
        clip = torch.where(norms > tau, tau / norms.clamp(min=torch.finfo(norms.dtype).tiny), torch.ones_like(norms))
        pull = share * clip
        step = pull - pull.sum() * coefficients  # sum_i pull_i (x_i - v), in coefficients of the offsets
        coefficients += step
        if max(float(step @ gram @ step), 0.0) ** 0.5 <= 1e-6 * tau:
            break
    return start + coefficients.to(offsets.dtype) @ offsets


def robust_aggregate(parts: torch.Tensor, tokens: torch.Tensor, caught: frozenset[int] = frozenset()) -> RobustResult:
    """Aggregate the rows of `parts` (one contribution each, finite), weighed by their claimed `tokens`.

    Colluding and one-sided parts are only flagged while they are a minority of the group (the rest is an honest
    group's normal), unless all of them come from `caught` senders: rejected before by this peer, for what no
    honest peer sends. Colluders that got into a group as half or more of it (2 + 2, or both with one honest
    peer) were otherwise never flagged there, round after round.

    Flagged contributions are left out of the result: first the opposed ones, then the astray ones (measured
    against the rest), then colluding and one-sided ones. A part with two verdicts gets the one with a strike
    (colluding before one-sided: a colluder's twins go with it, peers/reputation.py).
    """
    tokens = tokens.to(torch.float64)
    gram = (parts @ parts.T).double()  # every pairwise test reads it: one pass over the parts

    def rows(kept: list[int]) -> torch.Tensor:  # indexing copies the part: only when some row is left out
        return parts if len(kept) == parts.shape[0] else parts[kept]

    opposed, flipped = _opposed(gram, parts.shape[1])
    kept = [i for i in range(parts.shape[0]) if i not in opposed]
    aggregate, lean = _clipped_mean(rows(kept), tokens[kept])
    astray, far = _far(parts, tokens, aggregate)  # the opposed parts too: a long flip is far as well
    if astray & set(kept):
        kept = [i for i in kept if i not in astray]
        aggregate, lean = _clipped_mean(rows(kept), tokens[kept])
    suspected = frozenset(k for k, i in enumerate(kept) if i in caught)
    colluding = frozenset(kept[i] for i in _colluding(rows(kept), gram[kept][:, kept], aggregate, suspected))
    one_sided = frozenset(kept[i] for i in _one_sided(rows(kept), lean, aggregate, suspected)) - colluding
    if colluding | one_sided:
        kept = [i for i in kept if i not in colluding | one_sided]
        aggregate, _ = _clipped_mean(rows(kept), tokens[kept])
    return RobustResult(aggregate, far, colluding, one_sided, opposed - flipped - astray, flipped - far,
                        astray - far - flipped)


def _clipped_mean(parts: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The aggregate of `parts`, and each one's lean: the share of its values above their coordinate-wise median
    minus the share below (it falls out of the offsets CenteredClip starts from)."""
    weights = capped_weights(tokens)
    if float(weights.sum()) == 0:
        weights = torch.ones_like(weights)
    if parts.shape[0] == 1:
        return parts[0].clone(), torch.zeros(1)
    start = coordinate_median(parts)
    offsets = parts - start
    lean = _lean(offsets)
    tau = TAU_FACTOR * float(offsets.norm(dim=1).median())
    return (start if tau == 0 else centered_clip(offsets, weights, start, tau)), lean


def _lean(offsets: torch.Tensor) -> torch.Tensor:
    """Each row's share of positive values minus its share of negative ones. A block of columns at a time: the
    signs of a whole part at once are a temporary of its size, whose first touch cost 16 ms for 8 x 2^20 values
    against 2 ms in blocks."""
    total = torch.zeros(offsets.shape[0], dtype=torch.float64)
    blocks = _column_blocks(offsets)
    signs = torch.empty_like(offsets[:, blocks[0]]) if blocks else None  # reused: one block's worth
    for block in blocks:
        values = offsets[:, block]
        torch.sign(values, out=signs[:, : values.shape[1]])
        total += signs[:, : values.shape[1]].sum(dim=1)
    return (total / max(offsets.shape[1], 1)).to(offsets.dtype)


def _far(parts: torch.Tensor, tokens: torch.Tensor, aggregate: torch.Tensor) -> tuple[frozenset[int], frozenset[int]]:
    """(astray, far): the parts beyond FAR_RATIO, and beyond FAR_STRIKE_RATIO, times the median distance to
    `aggregate`, and beyond the reach their claimed tokens allow (see the module's docstring)."""
    if parts.shape[0] < 3:  # with two contributions, neither is the majority
        return frozenset(), frozenset()
    distances = (parts - aggregate).norm(dim=1)
    typical = float(distances.median())
    median_tokens = float(capped_weights(tokens).max())
    allowance = (tokens / max(median_tokens, 1e-30)).clamp(1.0, FAR_TOKEN_ALLOWANCE)
    reach = ((1.0 + allowance) * float(aggregate.norm())).tolist()
    beyond = [(i, d) for i, d in enumerate(distances.tolist()) if d > reach[i]]
    return (frozenset(i for i, d in beyond if d > FAR_RATIO * typical),
            frozenset(i for i, d in beyond if d > FAR_STRIKE_RATIO * typical))


def _opposed(gram: torch.Tensor, dimension: int) -> tuple[frozenset[int], frozenset[int]]:
    """(opposed, flipped): the parts pointing against most of the others, and those of them that point clearly
    against others that clearly agree (see the module's docstring)."""
    n = gram.shape[0]
    if n < 3:  # with two contributions, neither is the majority
        return frozenset(), frozenset()
    norms = gram.diagonal().clamp(min=0).sqrt()
    cosines = gram / (norms.unsqueeze(0) * norms.unsqueeze(1)).clamp(min=torch.finfo(torch.float64).tiny)
    # Unrelated vectors of d values have cosines of about +-1/sqrt(d): a short span needs a wider margin.
    margin = max(OPPOSED_COS, 4 / dimension**0.5)
    against = cosines < -margin
    against.fill_diagonal_(False)
    suspect = [i for i in range(n) if 2 * int(against[i].sum()) > n - 1]
    if 2 * len(suspect) >= n:  # a majority cannot be the odd ones out
        return frozenset(), frozenset()
    others = [i for i in range(n) if i not in suspect]
    pairs = torch.triu_indices(len(others), len(others), offset=1)
    agreement = float(cosines[others][:, others][pairs[0], pairs[1]].median())  # the lower middle, for an even count
    if agreement < max(FLIP_AGREEMENT, 2 * margin):
        return frozenset(suspect), frozenset()
    flipped = [i for i in suspect if 2 * int((cosines[i, others] < -FLIP_SHARE * agreement).sum()) > len(others)]
    return frozenset(suspect), frozenset(flipped)


def _colluding(parts: torch.Tensor, gram: torch.Tensor, aggregate: torch.Tensor,
               caught: frozenset[int]) -> frozenset[int]:
    # A part shorter than a code block (a small model's norm gains: hivemind makes each tensor its own part) goes
    # as signs and one scale, and its values move alike on every peer: honest parts of 64-128 values coincided
    # byte for byte in a swarm's first round (5 of 11 peers flagged), those of 256 and more never came closer than
    # half the median distance. Longer parts of the same span still catch a pair that sends one vector.
    if parts.shape[0] < 3 or parts.shape[1] < COLLUSION_MIN_VALUES:
        return frozenset()
    # pairwise distances from the n x n Gram matrix
    squared = gram.diagonal()
    distances = (squared.unsqueeze(0) + squared.unsqueeze(1) - 2 * gram).clamp(min=0).sqrt()
    pairs = torch.triu_indices(parts.shape[0], parts.shape[0], offset=1)
    typical = float(distances[pairs[0], pairs[1]].median())
    if typical == 0:
        return frozenset()
    # Small contributions (late joiners) are near one another, and too small to shift the result: never flagged.
    small = parts.norm(dim=1) < SMALL_SHARE * float(aggregate.norm())
    close = distances < COLLUSION_DISTANCE * typical
    close.fill_diagonal_(False)
    close[small] = False
    close[:, small] = False
    # Closeness is suspect only where it is rare. Most peers close together and one further out is an honest group
    # with an outlier (a peer out of step, say); most peers in close pairs are an honest group whose updates
    # hardly differ (16 peers trained on one repeated sentence flagged most of one another so, and banned 11 of
    # them within seven rounds): neither is collusion.
    suspects = frozenset(int(i) for i in torch.nonzero(close.any(dim=1)).flatten())
    return suspects if _flaggable(suspects, parts.shape[0], caught) else frozenset()


def _flaggable(suspects: frozenset[int], n: int, caught: frozenset[int]) -> bool:
    """Whether these parts may be flagged together: a minority of the `n`, or all from caught senders."""
    return bool(suspects) and (2 * len(suspects) < n or suspects <= caught)


def _one_sided(parts: torch.Tensor, lean: torch.Tensor, aggregate: torch.Tensor,
               caught: frozenset[int]) -> frozenset[int]:
    """The parts flagged as one-sided (see the module docstring); `lean` is theirs as `_clipped_mean` gave it."""
    n = parts.shape[0]
    if n < 3 or parts.shape[1] < ONE_SIDED_MIN_VALUES:
        return frozenset()
    judged = parts.norm(dim=1) >= SMALL_SHARE * float(aggregate.norm())
    if not bool((judged & (lean.abs() > ONE_SIDED / 2)).any()):  # the usual honest group: no need to look closer
        return frozenset()
    # A shorter part lies nearer zero than the median, so it leans against the median's own signs; at one length,
    # an honest part does not lean (a coded part's rotation and scales are unchanged by its length).
    norms = parts.norm(dim=1, keepdim=True)
    even = parts / norms.clamp(min=torch.finfo(parts.dtype).tiny) * norms.median()
    lean = _lean(even.sub_(coordinate_median(even)))
    for side in (lean > 0, lean < 0):
        members = frozenset(torch.nonzero(side).flatten().tolist())
        if _flaggable(members, n, caught) and all(judged[i] and abs(float(lean[i])) > ONE_SIDED for i in members):
            return members
    return frozenset()
