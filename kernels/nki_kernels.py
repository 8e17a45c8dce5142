"""NKI kernels for the fused ops, written against the `nki` namespace (NKI 0.3 to 0.7: `nki.jit`, every
`nki.isa` call with an explicit `dst`, outputs in `nl.shared_hbm`).

Import this module only through `kernels._nki.kernels()`: it needs the Neuron SDK. All kernels take 2-D
HBM tensors (rows = tokens) and follow one plan: rows go to SBUF partitions in tiles of 128, full tiles are
split between the physical cores of a logical core (LNC=2 runs the kernel twice, `nl.program_id` tells which
half), the ragged last tile goes to the last core, and per-row reductions stay on chip.

Loops are plain Python `range`, unrolled while NKI specializes the kernel (NKI 0.7 traces kernels with
Python; `nl.affine_range` is a deprecated alias of `range` there: docs nki/deep-dives/nki-loops). The per-core
split does Python arithmetic and `if` on `nl.program_id(0)`, as aws-neuron/nki-library's kernels do (a NEFF
at LNC=2 holds instructions specialized per physical core); never on a tile's value.

None of this has run on Trainium from this repository: the CPU tests execute it through a NumPy stand-in
for the API subset used here (`kernels._fake_nki`), and through the real `nki.simulate` where it is installed.
"""

from kernels._nki import NKI_AVAILABLE, nisa, nki, nl

if not NKI_AVAILABLE:  # pragma: no cover - kernels._nki.kernels() checks first
    raise ImportError("kernels.nki_kernels needs the Neuron SDK's nki package")

P = 128  # SBUF/PSUM partitions: rows per tile, and the matmul contraction and stationary limits
MOVING_MAX = 512  # matmul moving free size, and float32 elements in one 2 KiB PSUM bank
TOKEN_BLOCK = 512  # tokens per MLP block: x^T streams 512 columns per matmul
VOCAB_CHUNK = 2048  # logits columns per step of the online log-sum-exp
NEG_BIG = -1.0e30  # running-max start: exp(NEG_BIG - m) is 0 without inf - inf


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    """(start, length) pieces of range(total), each at most `size` long."""
    return [(s, min(size, total - s)) for s in range(0, total, size)]


def _programs() -> tuple[int, int]:
    """(number of physical cores running this kernel, which one this is); (1, 0) without LNC=2."""
    if nl.program_ndim() == 0:
        return 1, 0
    count = nl.num_programs(0)
    if count is None:
        return 1, 0
    return count, nl.program_id(0)


def _my_tiles(rows: int, tile: int) -> tuple[int, int, tuple[int, int] | None]:
    """This core's share of the row tiles: (first full tile, how many, (start, length) of a ragged tail or None)."""
    count, me = _programs()
    full = rows // tile
    per_core = -(-full // count)
    first = min(me * per_core, full)
    mine = min(per_core, full - first)
    rest = rows - full * tile
    tail = (full * tile, rest) if rest and me == count - 1 else None
    return first, mine, tail


def _col(dtype=None):
    """A [128, 1] per-row scalar tile (a per-partition operand for the vector and scalar engines)."""
    return nl.ndarray((P, 1), dtype=nl.float32 if dtype is None else dtype, buffer=nl.sbuf)


# ---------------------------------------------------------------------------------------------------------
# RMSNorm without weight: y = x * rsqrt(mean(x^2) + eps)


def _rmsnorm_fwd_tile(x, y, rstd, r0, rows, eps):
    d = x.shape[1]
    xt = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt[0:rows, :], src=x[r0:r0 + rows, :])
    # Square and sum along the row in one Scalar Engine pass.
    sq = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    ss = _col()
    nisa.activation_reduce(dst=sq[0:rows, :], op=nl.square, data=xt[0:rows, :], reduce_op=nl.add,
                           reduce_res=ss[0:rows, :])
    ms = _col()
    nisa.tensor_scalar(dst=ms[0:rows, :], data=ss[0:rows, :], op0=nl.multiply, operand0=1.0 / d,
                       op1=nl.add, operand1=eps)
    # sqrt then the Vector Engine's reciprocal: more precise than the Scalar Engine's rsqrt table.
    rt = _col()
    nisa.activation(dst=rt[0:rows, :], op=nl.sqrt, data=ms[0:rows, :])
    rs = _col()
    nisa.reciprocal(dst=rs[0:rows, :], data=rt[0:rows, :])
    yt = nl.ndarray((P, d), dtype=y.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=yt[0:rows, :], data=xt[0:rows, :], op0=nl.multiply, operand0=rs[0:rows, :])
    nisa.dma_copy(dst=y[r0:r0 + rows, :], src=yt[0:rows, :])
    nisa.dma_copy(dst=rstd[r0:r0 + rows, :], src=rs[0:rows, :])


@nki.jit
def rmsnorm_fwd(x, eps):
    """x [N, D] -> (y [N, D] in x's dtype, rstd [N, 1] float32, kept for the backward)."""
    n, d = x.shape
    y = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    first, mine, tail = _my_tiles(n, P)
    for i in range(mine):
        _rmsnorm_fwd_tile(x, y, rstd, (first + i) * P, P, eps)
    if tail:
        _rmsnorm_fwd_tile(x, y, rstd, tail[0], tail[1], eps)
    return y, rstd


def _rmsnorm_bwd_tile(dy, x, rstd, dx, r0, rows):
    d = x.shape[1]
    xt = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt[0:rows, :], src=x[r0:r0 + rows, :])
    gt = nl.ndarray((P, d), dtype=dy.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gt[0:rows, :], src=dy[r0:r0 + rows, :])
    rs = _col()
    nisa.dma_copy(dst=rs[0:rows, :], src=rstd[r0:r0 + rows, :])
    # dx = rstd * dy - x * rstd^3 * mean(dy * x)
    prod = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod[0:rows, :], data1=gt[0:rows, :], data2=xt[0:rows, :], op=nl.multiply)
    dot = _col()
    nisa.tensor_reduce(dst=dot[0:rows, :], op=nl.add, data=prod[0:rows, :], axis=1)
    r2 = _col()
    nisa.tensor_tensor(dst=r2[0:rows, :], data1=rs[0:rows, :], data2=rs[0:rows, :], op=nl.multiply)
    r3 = _col()
    nisa.tensor_tensor(dst=r3[0:rows, :], data1=r2[0:rows, :], data2=rs[0:rows, :], op=nl.multiply)
    coef = _col()  # -mean(dy * x) * rstd^3
    nisa.scalar_tensor_tensor(dst=coef[0:rows, :], data=dot[0:rows, :], op0=nl.multiply, operand0=-1.0 / d,
                              op1=nl.multiply, operand1=r3[0:rows, :])
    xc = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xc[0:rows, :], data=xt[0:rows, :], op0=nl.multiply, operand0=coef[0:rows, :])
    out = nl.ndarray((P, d), dtype=dx.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=out[0:rows, :], data=gt[0:rows, :], op0=nl.multiply, operand0=rs[0:rows, :],
                              op1=nl.add, operand1=xc[0:rows, :])
    nisa.dma_copy(dst=dx[r0:r0 + rows, :], src=out[0:rows, :])


@nki.jit
def rmsnorm_bwd(dy, x, rstd):
    """(dy [N, D], x [N, D], rstd [N, 1] float32) -> dx [N, D] in x's dtype."""
    n, d = x.shape
    dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    first, mine, tail = _my_tiles(n, P)
    for i in range(mine):
        _rmsnorm_bwd_tile(dy, x, rstd, dx, (first + i) * P, P)
    if tail:
        _rmsnorm_bwd_tile(dy, x, rstd, dx, tail[0], tail[1])
    return dx


# ---------------------------------------------------------------------------------------------------------
# ReLU² MLP: y = relu(x @ W_fc^T)^2 @ W_proj^T, the [tokens, mlp_dim] activation never leaving SBUF.
#
# Buffer plan (kernels.relu2_mlp.mlp_plan sizes it): the hidden dimension goes in groups of `group` units.
# Each group's weight slices are either loaded once and kept (resident) or loaded again for every token
# block (streamed), so the SBUF need grows with the model width, not with width x mlp width; y is summed
# over the groups in a float32 SBUF accumulator.


def _load_xt(x, b0, bt):
    """x[b0:b0+bt]^T in SBUF: one [<=128, bt] tile per 128 model dimensions (the matmul contraction)."""
    d = x.shape[1]
    xt = [nl.ndarray((P, TOKEN_BLOCK), dtype=x.dtype, buffer=nl.sbuf) for _ in _chunks(d, P)]
    for s0, ss in _chunks(bt, P):
        xs = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs[0:ss, :], src=x[b0 + s0:b0 + s0 + ss, :])
        for kc, (k0, ks) in enumerate(_chunks(d, P)):
            tp = nl.ndarray((P, P), dtype=x.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=tp[0:ks, 0:ss], data=xs[0:ss, k0:k0 + ks])
            nisa.tensor_copy(dst=xt[kc][0:ks, s0:s0 + ss], src=tp[0:ks, 0:ss])
    return xt


def _load_group(w_fc_t, w_proj_t, g0, gs):
    """One hidden group's weights in SBUF: W_fc^T[:, g0:g0+gs] per 128 model dims, W_proj^T[g0:g0+gs, :] per
    128 hidden units."""
    wfc = []
    for k0, ks in _chunks(w_fc_t.shape[0], P):
        t = nl.ndarray((P, gs), dtype=w_fc_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:ks, :], src=w_fc_t[k0:k0 + ks, g0:g0 + gs])
        wfc.append(t)
    wpr = []
    for j0, js in _chunks(gs, P):
        t = nl.ndarray((P, w_proj_t.shape[1]), dtype=w_proj_t.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:js, :], src=w_proj_t[g0 + j0:g0 + j0 + js, :])
        wpr.append(t)
    return wfc, wpr


def _mlp_group(xt, yacc, pre_t, weights, d, g0, gs, b0, bt, first):
    """Add one hidden group's share of y for a token block into yacc; write its pre-activation h^T."""
    wfc, wpr = weights
    dout = wpr[0].shape[1]
    k_chunks = _chunks(d, P)
    h_chunks = _chunks(gs, P)
    act = []
    for j0, js in h_chunks:  # h^T = W_fc x^T, 128 hidden units at a time
        hp = nl.ndarray((P, TOKEN_BLOCK), dtype=nl.float32, buffer=nl.psum)
        for kc, (_, ks) in enumerate(k_chunks):
            nisa.nc_matmul(dst=hp[0:js, 0:bt], stationary=wfc[kc][0:ks, j0:j0 + js], moving=xt[kc][0:ks, 0:bt],
                           accumulate=kc > 0)
        hs = nl.ndarray((P, TOKEN_BLOCK), dtype=pre_t.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=hs[0:js, 0:bt], src=hp[0:js, 0:bt])
        nisa.dma_copy(dst=pre_t[g0 + j0:g0 + j0 + js, b0:b0 + bt], src=hs[0:js, 0:bt])
        r = nl.ndarray((P, TOKEN_BLOCK), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=r[0:js, 0:bt], op=nl.relu, data=hp[0:js, 0:bt])
        a = nl.ndarray((P, TOKEN_BLOCK), dtype=xt[0].dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=a[0:js, 0:bt], data1=r[0:js, 0:bt], data2=r[0:js, 0:bt], op=nl.multiply)
        act.append(a)
    # y += relu(h)^2 W_proj^T: 128 tokens x <=512 outputs per PSUM bank, contracting over the group's chunks.
    for si, (s0, ss) in enumerate(_chunks(bt, P)):
        for c0, cs in _chunks(dout, MOVING_MAX):
            yp = nl.ndarray((P, MOVING_MAX), dtype=nl.float32, buffer=nl.psum)
            for jc, (_, js) in enumerate(h_chunks):
                nisa.nc_matmul(dst=yp[0:ss, 0:cs], stationary=act[jc][0:js, s0:s0 + ss],
                               moving=wpr[jc][0:js, c0:c0 + cs], accumulate=jc > 0)
            acc = yacc[si][0:ss, c0:c0 + cs]
            if first:
                nisa.tensor_copy(dst=acc, src=yp[0:ss, 0:cs])
            else:
                nisa.tensor_tensor(dst=acc, data1=acc, data2=yp[0:ss, 0:cs], op=nl.add)


def _mlp_block(x, y, pre_t, w_fc_t, w_proj_t, groups, resident, b0, bt):
    """One block of `bt` <= TOKEN_BLOCK tokens starting at row b0."""
    dout = y.shape[1]
    xt = _load_xt(x, b0, bt)
    yacc = [nl.ndarray((P, dout), dtype=nl.float32, buffer=nl.sbuf) for _ in _chunks(bt, P)]
    for gi, (g0, gs) in enumerate(groups):
        weights = resident[gi] if resident else _load_group(w_fc_t, w_proj_t, g0, gs)
        _mlp_group(xt, yacc, pre_t, weights, x.shape[1], g0, gs, b0, bt, gi == 0)
        del weights  # a streamed group's SBUF is free before the next one loads
    for si, (s0, ss) in enumerate(_chunks(bt, P)):
        ys = nl.ndarray((P, dout), dtype=y.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ys[0:ss, :], src=yacc[si][0:ss, :])
        nisa.dma_copy(dst=y[b0 + s0:b0 + s0 + ss, :], src=ys[0:ss, :])


@nki.jit
def relu2_mlp_fwd(x, w_fc_t, w_proj_t, group, keep_weights):
    """(x [N, D], W_fc^T [D, H], W_proj^T [H, Dout], one dtype; hidden group size; keep weights resident?) ->
    (y [N, Dout], h^T [H, N] pre-activation, kept for the backward).

    `group` and `keep_weights` come from kernels.relu2_mlp.mlp_plan, which sized them to fit SBUF.
    """
    n, d = x.shape
    d_w, h = w_fc_t.shape
    h_w, dout = w_proj_t.shape
    assert d == d_w and h == h_w, f"shapes disagree: x {x.shape}, W_fc^T {w_fc_t.shape}, W_proj^T {w_proj_t.shape}"
    y = nl.ndarray((n, dout), dtype=x.dtype, buffer=nl.shared_hbm)
    pre_t = nl.ndarray((h, n), dtype=x.dtype, buffer=nl.shared_hbm)
    groups = _chunks(h, group)
    resident = [_load_group(w_fc_t, w_proj_t, g0, gs) for g0, gs in groups] if keep_weights else None
    first, mine, tail = _my_tiles(n, TOKEN_BLOCK)
    for i in range(mine):
        _mlp_block(x, y, pre_t, w_fc_t, w_proj_t, groups, resident, (first + i) * TOKEN_BLOCK, TOKEN_BLOCK)
    if tail:
        _mlp_block(x, y, pre_t, w_fc_t, w_proj_t, groups, resident, tail[0], tail[1])
    return y, pre_t


# ---------------------------------------------------------------------------------------------------------
# Softcapped cross-entropy: z = softcap * tanh(logits / softcap); loss = logsumexp(z) - z[target], in float32.


def _class_index():
    """[128, VOCAB_CHUNK] float32 tile whose every row is 0, 1, 2, ...: compared with a shifted target it
    gives the one-hot row without an indirect gather."""
    idx = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=idx, pattern=[[1, VOCAB_CHUNK]], offset=0, channel_multiplier=0)
    return idx


def _load_targets(targets, r0, rows):
    ti = _col(nl.int32)
    nisa.dma_copy(dst=ti[0:rows, :], src=targets[r0:r0 + rows, :])
    tf = _col()
    nisa.tensor_copy(dst=tf[0:rows, :], src=ti[0:rows, :])
    return tf


def _one_hot(idx, tf, rows, c0, cs):
    """[rows, cs] float32: 1.0 where column c0 + j is the row's target (never for target -1)."""
    shifted = _col()
    nisa.tensor_scalar(dst=shifted[0:rows, :], data=tf[0:rows, :], op0=nl.subtract, operand0=float(c0))
    eq = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=eq[0:rows, 0:cs], data=idx[0:rows, 0:cs], op0=nl.equal, operand0=shifted[0:rows, :])
    return eq


def _ce_fwd_tile(logits, targets, loss, lse, idx, r0, rows, softcap):
    v = logits.shape[1]
    tf = _load_targets(targets, r0, rows)
    m = _col()
    nisa.memset(dst=m[0:rows, :], value=NEG_BIG)
    s = _col()
    nisa.memset(dst=s[0:rows, :], value=0.0)
    zt = _col()
    nisa.memset(dst=zt[0:rows, :], value=0.0)
    for c0, cs in _chunks(v, VOCAB_CHUNK):
        lt = nl.ndarray((P, VOCAB_CHUNK), dtype=logits.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=lt[0:rows, 0:cs], src=logits[r0:r0 + rows, c0:c0 + cs])
        z = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
        if softcap > 0:
            u = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=u[0:rows, 0:cs], op=nl.tanh, data=lt[0:rows, 0:cs], scale=1.0 / softcap)
            nisa.tensor_scalar(dst=z[0:rows, 0:cs], data=u[0:rows, 0:cs], op0=nl.multiply, operand0=float(softcap))
        else:
            nisa.tensor_copy(dst=z[0:rows, 0:cs], src=lt[0:rows, 0:cs])
        # Online log-sum-exp: m_new = max(m, max z); s = s * exp(m - m_new) + sum exp(z - m_new).
        cmax = _col()
        nisa.tensor_reduce(dst=cmax[0:rows, :], op=nl.maximum, data=z[0:rows, 0:cs], axis=1)
        m_new = _col()
        nisa.tensor_tensor(dst=m_new[0:rows, :], data1=m[0:rows, :], data2=cmax[0:rows, :], op=nl.maximum)
        neg_m = _col()
        nisa.tensor_scalar(dst=neg_m[0:rows, :], data=m_new[0:rows, :], op0=nl.multiply, operand0=-1.0)
        corr = _col()
        nisa.activation(dst=corr[0:rows, :], op=nl.exp, data=m[0:rows, :], bias=neg_m[0:rows, :])
        e = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
        csum = _col()
        nisa.activation_reduce(dst=e[0:rows, 0:cs], op=nl.exp, data=z[0:rows, 0:cs], reduce_op=nl.add,
                               reduce_res=csum[0:rows, :], bias=neg_m[0:rows, :])
        s_new = _col()
        nisa.scalar_tensor_tensor(dst=s_new[0:rows, :], data=s[0:rows, :], op0=nl.multiply, operand0=corr[0:rows, :],
                                  op1=nl.add, operand1=csum[0:rows, :])
        # The target's capped logit, picked with a one-hot mask and a row sum.
        eq = _one_hot(idx, tf, rows, c0, cs)
        picked = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=picked[0:rows, 0:cs], data1=eq[0:rows, 0:cs], data2=z[0:rows, 0:cs], op=nl.multiply)
        pz = _col()
        nisa.tensor_reduce(dst=pz[0:rows, :], op=nl.add, data=picked[0:rows, 0:cs], axis=1)
        zt_new = _col()
        nisa.tensor_tensor(dst=zt_new[0:rows, :], data1=zt[0:rows, :], data2=pz[0:rows, :], op=nl.add)
        m, s, zt = m_new, s_new, zt_new
    log_s = _col()
    nisa.activation(dst=log_s[0:rows, :], op=nl.log, data=s[0:rows, :])
    lse_t = _col()
    nisa.tensor_tensor(dst=lse_t[0:rows, :], data1=m[0:rows, :], data2=log_s[0:rows, :], op=nl.add)
    diff = _col()
    nisa.tensor_tensor(dst=diff[0:rows, :], data1=lse_t[0:rows, :], data2=zt[0:rows, :], op=nl.subtract)
    valid = _col()  # ignore_index=-1: those rows contribute 0
    nisa.tensor_scalar(dst=valid[0:rows, :], data=tf[0:rows, :], op0=nl.greater_equal, operand0=0.0)
    out = _col()
    nisa.tensor_tensor(dst=out[0:rows, :], data1=diff[0:rows, :], data2=valid[0:rows, :], op=nl.multiply)
    nisa.dma_copy(dst=loss[r0:r0 + rows, :], src=out[0:rows, :])
    nisa.dma_copy(dst=lse[r0:r0 + rows, :], src=lse_t[0:rows, :])


@nki.jit
def softcap_ce_fwd(logits, targets, softcap):
    """(logits [N, V], targets [N, 1] int32 with -1 = ignore, softcap >= 0 a constant) ->
    (loss [N, 1] float32, 0 where ignored; lse [N, 1] float32 of the capped logits, for the backward)."""
    n = logits.shape[0]
    loss = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    idx = _class_index()
    first, mine, tail = _my_tiles(n, P)
    for i in range(mine):
        _ce_fwd_tile(logits, targets, loss, lse, idx, (first + i) * P, P, softcap)
    if tail:
        _ce_fwd_tile(logits, targets, loss, lse, idx, tail[0], tail[1], softcap)
    return loss, lse


def _ce_bwd_tile(logits, targets, lse, gscale, dlogits, idx, r0, rows, softcap):
    v = logits.shape[1]
    tf = _load_targets(targets, r0, rows)
    lt_lse = _col()
    nisa.dma_copy(dst=lt_lse[0:rows, :], src=lse[r0:r0 + rows, :])
    neg_lse = _col()
    nisa.tensor_scalar(dst=neg_lse[0:rows, :], data=lt_lse[0:rows, :], op0=nl.multiply, operand0=-1.0)
    g = _col()
    nisa.dma_copy(dst=g[0:rows, :], src=gscale[r0:r0 + rows, :])
    for c0, cs in _chunks(v, VOCAB_CHUNK):
        lt = nl.ndarray((P, VOCAB_CHUNK), dtype=logits.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=lt[0:rows, 0:cs], src=logits[r0:r0 + rows, c0:c0 + cs])
        p = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)  # softmax(z)
        if softcap > 0:
            u = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=u[0:rows, 0:cs], op=nl.tanh, data=lt[0:rows, 0:cs], scale=1.0 / softcap)
            nisa.activation(dst=p[0:rows, 0:cs], op=nl.exp, data=u[0:rows, 0:cs], scale=float(softcap),
                            bias=neg_lse[0:rows, :])
        else:
            nisa.activation(dst=p[0:rows, 0:cs], op=nl.exp, data=lt[0:rows, 0:cs], bias=neg_lse[0:rows, :])
        eq = _one_hot(idx, tf, rows, c0, cs)
        dz = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dz[0:rows, 0:cs], data1=p[0:rows, 0:cs], data2=eq[0:rows, 0:cs], op=nl.subtract)
        if softcap > 0:  # dz/dlogits = 1 - tanh^2
            usq = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=usq[0:rows, 0:cs], op=nl.square, data=u[0:rows, 0:cs])
            w = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=w[0:rows, 0:cs], data=usq[0:rows, 0:cs], op0=nl.multiply, operand0=-1.0,
                               op1=nl.add, operand1=1.0)
            dl = nl.ndarray((P, VOCAB_CHUNK), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dl[0:rows, 0:cs], data1=dz[0:rows, 0:cs], data2=w[0:rows, 0:cs], op=nl.multiply)
        else:
            dl = dz
        out = nl.ndarray((P, VOCAB_CHUNK), dtype=dlogits.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out[0:rows, 0:cs], data=dl[0:rows, 0:cs], op0=nl.multiply, operand0=g[0:rows, :])
        nisa.dma_copy(dst=dlogits[r0:r0 + rows, c0:c0 + cs], src=out[0:rows, 0:cs])


@nki.jit
def softcap_ce_bwd(logits, targets, lse, gscale, softcap):
    """dlogits = gscale * (softmax(z) - onehot(target)) * dz/dlogits, in logits' dtype.

    gscale [N, 1] float32 is the per-row weight of the loss (0 for ignored rows, 1/count under 'mean').
    """
    n, v = logits.shape
    dlogits = nl.ndarray((n, v), dtype=logits.dtype, buffer=nl.shared_hbm)
    idx = _class_index()
    first, mine, tail = _my_tiles(n, P)
    for i in range(mine):
        _ce_bwd_tile(logits, targets, lse, gscale, dlogits, idx, (first + i) * P, P, softcap)
    if tail:
        _ce_bwd_tile(logits, targets, lse, gscale, dlogits, idx, tail[0], tail[1], softcap)
    return dlogits
