//! Every CUDA kernel of `chorus-kernels`, compiled for the host (`host/`),
//! against the CPU reference of its op on awkward shapes: rows wider than a
//! block, sequences that are not a multiple of a tile, query/key offsets
//! (a decode after a cache), grouped-query ratios 1, 2 and 4, the
//! tensor-core attention (bf16 and f16, head_dim 64 and 128) and its
//! fallback (any dtype and head_dim). Outputs start as NaN, so an element a
//! kernel does not write fails the comparison.
//!
//! What this cannot show: the GPU compilers' code generation, the hardware's
//! own mma accumulation order and `ex2.approx`, and the launches from Rust
//! (`src/cuda.rs`); `ci/gpu-check.sh`'s `kernels` check runs the same
//! comparisons on a GPU.

use crate::host;

use chorus_kernels::attention::{self, AttentionShape};
use chorus_kernels::{cross_entropy, rms_norm, rope, swiglu};
use host::{kernels, rel_err, Buf, Fmt, Rng};

const ALL: [Fmt; 3] = [Fmt::F32, Fmt::Bf16, Fmt::F16];

/// The relative error an output of `fmt` may have against the f32 reference:
/// a few roundings of the format (f32 sums in another order).
fn tol(fmt: Fmt) -> f32 {
    match fmt {
        Fmt::F32 => 2e-5,
        Fmt::Bf16 => 1.2e-2,
        Fmt::F16 => 2e-3,
    }
}

fn rounded(fmt: Fmt, v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| fmt.round(x)).collect()
}

type P = u64;

#[test]
fn rms_norm_forward_and_backward_match_the_reference() {
    let k = kernels();
    let mut rng = Rng(1);
    let eps = 1e-5f32;
    for fmt in ALL {
        for (rows, d) in [(3usize, 37usize), (2, 300)] {
            let x = rounded(fmt, rng.values(rows * d, 2.0));
            let w = rounded(fmt, rng.values(d, 1.0).into_iter().map(|v| 1.0 + 0.5 * v).collect());
            let dy = rounded(fmt, rng.values(rows * d, 1.0));
            let (bx, bw, bdy) = (Buf::from_f32(fmt, &x), Buf::from_f32(fmt, &w), Buf::from_f32(fmt, &dy));
            let s = fmt.suffix();
            let what = format!("rms_norm {s} {rows}x{d}");

            let mut y = Buf::poisoned(fmt, rows * d);
            let (px, pw, py) = (bx.ptr(), bw.ptr(), y.ptr_mut());
            let f: unsafe extern "C" fn(P, P, P, i32, f32) = k.get(&format!("chorus_rms_norm_forward_{s}"));
            // SAFETY: rows × d elements in and out, d weights.
            k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pw, py, d as i32, eps) });
            let want = rms_norm::forward(&x, &w, eps, |v| fmt.round(v));
            assert!(rel_err(&what, &y.to_f32(), &want) <= tol(fmt), "{what} forward");

            let mut dx = Buf::poisoned(fmt, rows * d);
            let (pdy, pdx) = (bdy.ptr(), dx.ptr_mut());
            let f: unsafe extern "C" fn(P, P, P, P, i32, f32) = k.get(&format!("chorus_rms_norm_backward_x_{s}"));
            // SAFETY: as above.
            k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pw, pdy, pdx, d as i32, eps) });
            let want = rounded(fmt, rms_norm::backward_x(&x, &w, &dy, eps));
            assert!(rel_err(&what, &dx.to_f32(), &want) <= tol(fmt), "{what} dx");

            let parts = rows.min(256);
            let mut rstd = Buf::poisoned(Fmt::F32, rows);
            let mut partial = Buf::poisoned(Fmt::F32, parts * d);
            let mut dw = Buf::poisoned(fmt, d);
            let (pr, pp, pdw) = (rstd.ptr_mut(), partial.ptr_mut(), dw.ptr_mut());
            let f: unsafe extern "C" fn(P, P, i32, f32) = k.get(&format!("chorus_rms_norm_rstd_{s}"));
            // SAFETY: rows values of rstd.
            k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pr, d as i32, eps) });
            let cols = (d as u32).div_ceil(256);
            let f: unsafe extern "C" fn(P, P, P, P, i32, i32) =
                k.get(&format!("chorus_rms_norm_backward_w_partial_{s}"));
            // SAFETY: parts × d partial sums.
            k.launch((cols, parts as u32, 1), 256, || unsafe { f(px, pdy, pr, pp, rows as i32, d as i32) });
            let f: unsafe extern "C" fn(P, P, i32, i32) = k.get(&format!("chorus_rms_norm_backward_w_sum_{s}"));
            // SAFETY: d sums.
            k.launch((cols, 1, 1), 256, || unsafe { f(pp, pdw, parts as i32, d as i32) });
            let want = rounded(fmt, rms_norm::backward_w(&x, &dy, d, eps));
            assert!(rel_err(&what, &dw.to_f32(), &want) <= tol(fmt), "{what} dw");
        }
    }
}

#[test]
fn rope_and_its_inverse_match_the_reference() {
    let k = kernels();
    let mut rng = Rng(2);
    let (b, t, h, d) = (2usize, 5usize, 3usize, 10usize);
    let cos = rng.values(t * d / 2, 1.0);
    let sin = rng.values(t * d / 2, 1.0);
    let (bc, bs) = (Buf::from_f32(Fmt::F32, &cos), Buf::from_f32(Fmt::F32, &sin));
    for fmt in ALL {
        let x = rounded(fmt, rng.values(b * t * h * d, 1.0));
        let bx = Buf::from_f32(fmt, &x);
        for inverse in [false, true] {
            let mut y = Buf::poisoned(fmt, x.len());
            let (px, pc, ps, py) = (bx.ptr(), bc.ptr(), bs.ptr(), y.ptr_mut());
            let f: unsafe extern "C" fn(P, P, P, P, u64, i32, i32, i32, f32) =
                k.get(&format!("chorus_rope_{}", fmt.suffix()));
            let pairs = (x.len() / 2) as u64;
            let sign = if inverse { -1.0 } else { 1.0 };
            // SAFETY: b·t·h·d elements, tables of t × d/2; 2 blocks stride over the pairs.
            k.launch((2, 1, 1), 32, || unsafe { f(px, pc, ps, py, pairs, t as i32, h as i32, d as i32, sign) });
            let want = rounded(fmt, rope::forward(&x, &cos, &sin, t, h, d, inverse));
            let what = format!("rope {fmt:?} inverse={inverse}");
            assert!(rel_err(&what, &y.to_f32(), &want) <= tol(fmt), "{what}");
        }
    }
}

#[test]
fn swiglu_forward_and_backward_match_the_reference() {
    let k = kernels();
    let mut rng = Rng(3);
    let n = 301usize;
    for fmt in ALL {
        let (g, u, dy) =
            (rounded(fmt, rng.values(n, 4.0)), rounded(fmt, rng.values(n, 1.0)), rounded(fmt, rng.values(n, 1.0)));
        let (bg, bu, bdy) = (Buf::from_f32(fmt, &g), Buf::from_f32(fmt, &u), Buf::from_f32(fmt, &dy));
        let s = fmt.suffix();
        let mut y = Buf::poisoned(fmt, n);
        let (pg, pu, pdy, py) = (bg.ptr(), bu.ptr(), bdy.ptr(), y.ptr_mut());
        let f: unsafe extern "C" fn(P, P, P, u64) = k.get(&format!("chorus_swiglu_forward_{s}"));
        // SAFETY: n elements each.
        k.launch((1, 1, 1), 64, || unsafe { f(pg, pu, py, n as u64) });
        assert!(rel_err("swiglu", &y.to_f32(), &rounded(fmt, swiglu::forward(&g, &u))) <= tol(fmt), "{fmt:?}");
        let mut both = Buf::poisoned(fmt, 2 * n);
        let pb = both.ptr_mut();
        let f: unsafe extern "C" fn(P, P, P, P, u64) = k.get(&format!("chorus_swiglu_backward_{s}"));
        // SAFETY: n in, 2n out.
        k.launch((2, 1, 1), 64, || unsafe { f(pg, pu, pdy, pb, n as u64) });
        let (dg, du) = swiglu::backward(&g, &u, &dy);
        let got = both.to_f32();
        assert!(rel_err("swiglu dg", &got[..n], &rounded(fmt, dg)) <= tol(fmt), "{fmt:?}");
        assert!(rel_err("swiglu du", &got[n..], &rounded(fmt, du)) <= tol(fmt), "{fmt:?}");
    }
}

#[test]
fn cross_entropy_forward_and_backward_match_the_reference_and_flag_bad_targets() {
    let k = kernels();
    let mut rng = Rng(4);
    let (rows, vocab) = (4usize, 1000usize);
    for fmt in ALL {
        let x = rounded(fmt, rng.values(rows * vocab, 8.0));
        let mut targets: Vec<u32> = (0..rows as u32).map(|r| r * 313 % vocab as u32).collect();
        let g: Vec<f32> = (0..rows).map(|r| 0.25 + r as f32).collect();
        let bx = Buf::from_f32(fmt, &x);
        let bt: Vec<u8> = targets.iter().flat_map(|t| t.to_le_bytes()).collect();
        let bg = Buf::from_f32(Fmt::F32, &g);
        let s = fmt.suffix();
        let (mut loss, mut lse) = (Buf::poisoned(Fmt::F32, rows), Buf::poisoned(Fmt::F32, rows));
        let (px, pt, pl, pe) = (bx.ptr(), bt.as_ptr() as u64, loss.ptr_mut(), lse.ptr_mut());
        let f: unsafe extern "C" fn(P, P, P, P, i32) = k.get(&format!("chorus_cross_entropy_forward_{s}"));
        // SAFETY: rows × vocab logits, rows targets, losses and sums.
        k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pt, pl, pe, vocab as i32) });
        let (want_loss, want_lse) = cross_entropy::forward(&x, &targets, vocab).unwrap();
        assert!(rel_err("ce loss", &loss.to_f32(), &want_loss) <= 2e-5, "{fmt:?}");
        assert!(rel_err("ce lse", &lse.to_f32(), &want_lse) <= 2e-5, "{fmt:?}");
        let mut dx = Buf::poisoned(fmt, rows * vocab);
        let (pg, pdx) = (bg.ptr(), dx.ptr_mut());
        let f: unsafe extern "C" fn(P, P, P, P, P, i32) = k.get(&format!("chorus_cross_entropy_backward_{s}"));
        // SAFETY: as above, rows × vocab gradients.
        k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pt, pg, pe, pdx, vocab as i32) });
        let want = rounded(fmt, cross_entropy::backward(&x, &targets, &want_lse, &g, vocab));
        assert!(rel_err("ce dx", &dx.to_f32(), &want) <= tol(fmt), "{fmt:?}");

        // A target outside the vocabulary: that row's loss and gradient are NaN, the others unchanged.
        targets[1] = vocab as u32;
        let bt: Vec<u8> = targets.iter().flat_map(|t| t.to_le_bytes()).collect();
        let pt = bt.as_ptr() as u64;
        let f: unsafe extern "C" fn(P, P, P, P, i32) = k.get(&format!("chorus_cross_entropy_forward_{s}"));
        // SAFETY: as above.
        k.launch((rows as u32, 1, 1), 256, || unsafe { f(px, pt, pl, pe, vocab as i32) });
        let got = loss.to_f32();
        assert!(got[1].is_nan(), "{fmt:?}: {got:?}");
        let others = |v: &[f32]| [v[0], v[2], v[3]];
        assert!(rel_err("ce loss, other rows", &others(&got), &others(&want_loss)) <= 2e-5, "{fmt:?}: {got:?}");
    }
}

/// Random q, k, v, dO of `sh` in `fmt` (rounded), and a scale.
struct AttentionCase {
    sh: AttentionShape,
    fmt: Fmt,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
    scale: f32,
}

impl AttentionCase {
    fn new(seed: u64, fmt: Fmt, sh: AttentionShape) -> AttentionCase {
        let mut rng = Rng(seed);
        let nq = sh.batch * sh.q_len * sh.heads * sh.head_dim;
        let nkv = sh.batch * sh.kv_len * sh.kv_heads * sh.head_dim;
        AttentionCase {
            sh,
            fmt,
            q: rounded(fmt, rng.values(nq, 1.5)),
            k: rounded(fmt, rng.values(nkv, 1.5)),
            v: rounded(fmt, rng.values(nkv, 1.0)),
            d_o: rounded(fmt, rng.values(nq, 1.0)),
            // Larger than 1/sqrt(d): peaked rows, where a masking or max error shows.
            scale: 2.0 / (sh.head_dim as f32).sqrt(),
        }
    }

    /// The kernels' forward and backward (tensor-core or fallback by name) against the reference.
    fn check(&self, tensor_cores: bool) {
        let k = kernels();
        let (sh, fmt, s) = (self.sh, self.fmt, self.fmt.suffix());
        let what = format!("attention {fmt:?} {sh:?} tensor_cores={tensor_cores}");
        let nq = self.q.len();
        let nkv = self.k.len();
        let (bq, bk, bv, bdo) = (
            Buf::from_f32(fmt, &self.q),
            Buf::from_f32(fmt, &self.k),
            Buf::from_f32(fmt, &self.v),
            Buf::from_f32(fmt, &self.d_o),
        );
        let (b, t, skv, h, kvh, d) = (
            sh.batch as i32,
            sh.q_len as i32,
            sh.kv_len as i32,
            sh.heads as i32,
            sh.kv_heads as i32,
            sh.head_dim as i32,
        );
        let rows = sh.batch * sh.q_len * sh.heads;
        let mut o = Buf::poisoned(fmt, nq);
        let mut lse = Buf::poisoned(Fmt::F32, rows);
        let (pq, pk, pv, pdo, po, pl) = (bq.ptr(), bk.ptr(), bv.ptr(), bdo.ptr(), o.ptr_mut(), lse.ptr_mut());
        if tensor_cores {
            let f: unsafe extern "C" fn(P, P, P, P, P, i32, i32, i32, i32, f32) =
                k.get(&format!("chorus_attention_forward_{s}_d{d}"));
            let grid = (sh.q_len.div_ceil(64) as u32, sh.heads as u32, sh.batch as u32);
            let scale_log2 = self.scale * std::f32::consts::LOG2_E;
            // SAFETY: the shapes of `sh`.
            k.launch(grid, 128, || unsafe { f(pq, pk, pv, po, pl, t, skv, h, kvh, scale_log2) });
        } else {
            let f: unsafe extern "C" fn(P, P, P, P, P, i32, i32, i32, i32, i32, i32, f32) =
                k.get(&format!("chorus_attention_forward_simple_{s}"));
            let scale = self.scale;
            // SAFETY: the shapes of `sh`, a warp per query row.
            k.launch((rows.div_ceil(4) as u32, 1, 1), 128, || unsafe {
                f(pq, pk, pv, po, pl, b, t, skv, h, kvh, d, scale)
            });
        }
        let (want_o, want_lse) = attention::forward(&self.q, &self.k, &self.v, sh, self.scale);
        let tol_o = if tensor_cores { 2.5e-2 } else { tol(fmt) };
        assert!(rel_err(&what, &o.to_f32(), &rounded(fmt, want_o.clone())) <= tol_o, "{what}: o");
        assert!(rel_err(&what, &lse.to_f32(), &want_lse) <= 1e-4, "{what}: lse");

        // Backward, from the kernel's own o and lse (as the op runs it).
        let mut dvec = Buf::poisoned(Fmt::F32, rows);
        let pdv = dvec.ptr_mut();
        let f: unsafe extern "C" fn(P, P, P, i32, i32, i32, i32) = k.get(&format!("chorus_attention_backward_dot_{s}"));
        let po = o.ptr();
        // SAFETY: a warp per query row.
        k.launch((rows.div_ceil(4) as u32, 1, 1), 128, || unsafe { f(pdo, po, pdv, b, t, h, d) });
        let mut all = Buf::poisoned(fmt, nq + 2 * nkv);
        let es = match fmt {
            Fmt::F32 => 4,
            _ => 2,
        };
        let pall = all.ptr_mut();
        let (pdq, pdk, pdvv) = (pall, pall + (nq * es) as u64, pall + ((nq + nkv) * es) as u64);
        let pl = lse.ptr();
        if tensor_cores {
            let mut acc = Buf::from_f32(Fmt::F32, &vec![0.0; nq]);
            let pacc = acc.ptr_mut();
            let warps: u32 = if d == 64 { 4 } else { 2 };
            let grid = (sh.kv_len.div_ceil(16 * warps as usize) as u32, sh.kv_heads as u32, sh.batch as u32);
            let f: unsafe extern "C" fn(P, P, P, P, P, P, P, P, P, i32, i32, i32, i32, f32) =
                k.get(&format!("chorus_attention_backward_{s}_d{d}"));
            let scale = self.scale;
            // SAFETY: the shapes of `sh`; dq accumulates in `acc`.
            k.launch(grid, 32 * warps, || unsafe {
                f(pq, pk, pv, pdo, pl, pdv, pacc, pdk, pdvv, t, skv, h, kvh, scale)
            });
            let f: unsafe extern "C" fn(P, P, u64) = k.get(&format!("chorus_attention_backward_dq_{s}"));
            // SAFETY: nq elements.
            k.launch((2, 1, 1), 64, || unsafe { f(pacc, pdq, nq as u64) });
        } else {
            let scale = self.scale;
            let f: unsafe extern "C" fn(P, P, P, P, P, P, P, i32, i32, i32, i32, i32, i32, f32) =
                k.get(&format!("chorus_attention_backward_simple_dq_{s}"));
            // SAFETY: a warp per query row.
            k.launch((rows.div_ceil(4) as u32, 1, 1), 128, || unsafe {
                f(pq, pk, pv, pdo, pl, pdv, pdq, b, t, skv, h, kvh, d, scale)
            });
            let key_rows = sh.batch * sh.kv_len * sh.kv_heads;
            let f: unsafe extern "C" fn(P, P, P, P, P, P, P, P, i32, i32, i32, i32, i32, i32, f32) =
                k.get(&format!("chorus_attention_backward_simple_dkv_{s}"));
            // SAFETY: a warp per key row.
            k.launch((key_rows.div_ceil(4) as u32, 1, 1), 128, || unsafe {
                f(pq, pk, pv, pdo, pl, pdv, pdk, pdvv, b, t, skv, h, kvh, d, scale)
            });
        }
        let (dq, dk, dv) =
            attention::backward(&self.q, &self.k, &self.v, &want_o, &want_lse, &self.d_o, sh, self.scale);
        let got = all.to_f32();
        let tol_g = if tensor_cores { 4e-2 } else { 2.0 * tol(fmt) };
        assert!(rel_err(&what, &got[..nq], &dq) <= tol_g, "{what}: dq {}", rel_err(&what, &got[..nq], &dq));
        assert!(
            rel_err(&what, &got[nq..nq + nkv], &dk) <= tol_g,
            "{what}: dk {}",
            rel_err(&what, &got[nq..nq + nkv], &dk)
        );
        assert!(rel_err(&what, &got[nq + nkv..], &dv) <= tol_g, "{what}: dv {}", rel_err(&what, &got[nq + nkv..], &dv));
    }
}

fn shape(batch: usize, q_len: usize, kv_len: usize, heads: usize, kv_heads: usize, head_dim: usize) -> AttentionShape {
    AttentionShape { batch, q_len, kv_len, heads, kv_heads, head_dim }
}

#[test]
fn tensor_core_attention_matches_the_reference_bf16_gqa_ratios() {
    // 80 queries: a full tile of 64 and a part; ratios 1, 2 and 4.
    for (i, kvh) in [4usize, 2, 1].into_iter().enumerate() {
        AttentionCase::new(10 + i as u64, Fmt::Bf16, shape(1, 80, 80, 4, kvh, 64)).check(true);
    }
}

#[test]
fn tensor_core_attention_matches_the_reference_with_an_offset_and_f16() {
    // 30 new queries after 50 cached keys, two sequences.
    AttentionCase::new(20, Fmt::Bf16, shape(2, 30, 80, 2, 1, 64)).check(true);
    AttentionCase::new(21, Fmt::F16, shape(1, 70, 70, 2, 2, 64)).check(true);
    // 70 queries after 62 cached keys: the first tile's last key (63) is one
    // past what the first query sees (62), so a forward that takes the tile
    // as seen whole one key too early shows; the tiles of the second query
    // tile before the diagonal are seen whole.
    AttentionCase::new(22, Fmt::Bf16, shape(1, 70, 132, 2, 1, 64)).check(true);
}

/// The backward's mask at a tile's edge, exactly: with the output's gradient
/// only on the first query, which sees keys 0..=62 of the first key tile,
/// key 63's dK and dV are zero, and one leaked probability is as large as
/// the values the check compares (a leak among many queries would hide
/// within bf16's tolerance).
#[test]
fn tensor_core_attention_backward_masks_exactly_at_a_tile_edge() {
    let sh = shape(1, 70, 132, 1, 1, 64);
    let mut case = AttentionCase::new(23, Fmt::Bf16, sh);
    let first_row = sh.heads * sh.head_dim;
    case.d_o[first_row..].iter_mut().for_each(|g| *g = 0.0);
    case.check(true);
}

#[test]
fn tensor_core_attention_matches_the_reference_head_dim_128() {
    AttentionCase::new(30, Fmt::Bf16, shape(1, 40, 40, 2, 1, 128)).check(true);
}

#[test]
fn fallback_attention_matches_the_reference_any_dtype_and_head_dim() {
    AttentionCase::new(40, Fmt::F32, shape(2, 37, 37, 4, 2, 24)).check(false);
    AttentionCase::new(41, Fmt::F32, shape(1, 9, 20, 3, 1, 70)).check(false);
    AttentionCase::new(42, Fmt::Bf16, shape(1, 33, 33, 8, 1, 40)).check(false);
    AttentionCase::new(43, Fmt::F16, shape(1, 16, 16, 2, 2, 8)).check(false);
}
