//! aarch64 NEON kernels (with and without `sdot`), twins of `packed` and `reference`.
//!
//! The `sdot` matmuls are `asm!` loops: the dot-product intrinsics are unstable on our compiler, and
//! decode speed comes down to the instructions spent per weight block. Everything else uses
//! intrinsics inside `#[target_feature(enable = "neon")]` functions (NEON is in the aarch64
//! baseline, so calling them is always sound); f16 <-> f32 goes through `fcvtl`/`fcvtn` instead of
//! the `half` crate's software conversion.

use core::arch::aarch64::*;
use core::arch::asm;
use core::ops::Range;

use super::packed::{quantize_act_ref, ActBlock, PackedFormat, PackedMatrix, BLOCK, GROUP_ROWS};
use super::reference::{
    f32_to_f16_ref, flash_attn_row_ref, flash_attn_rows_ref, rope_rotate_ref, swiglu_ref, FLASH_ROWS,
};
use crate::quant::blocks::F16Le;

// ---------------------------------------------------------------------------------------------
// Shared matmul plumbing

/// Checks everything the kernels rely on to stay inside the buffers (they read through raw
/// pointers); returns the token count, or `None` when there is nothing to compute.
fn matmul_tokens(
    w: &PackedMatrix<'_>,
    groups: &Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) -> Option<usize> {
    assert!(w.is_consistent() && groups.start <= groups.end && groups.end <= w.groups(), "bad matmul shape");
    let (n, nb, rows) = (acts.len().min(outs.len()), w.blocks(), GROUP_ROWS * groups.len());
    for (a, o) in acts.iter().zip(outs.iter()) {
        assert!(a.len() >= nb && o.len() >= rows, "activation or output row too short");
    }
    if nb == 0 {
        outs.iter_mut().take(n).for_each(|o| o[..rows].fill(0.0));
        return None;
    }
    (n > 0 && rows > 0).then_some(n)
}

/// 64 zero bytes: one `ld1` of them clears up to four vector registers.
static ZEROS: [f32; 16] = [0.0; 16];

// ---------------------------------------------------------------------------------------------
// Packed matmul with `sdot`
//
// Each kernel call walks a run of row groups for 1 to 16 tokens; the group loop and the block
// loop are inside one `asm!` block. Three kernel shapes:
//
// * Wide tiles (16 tokens, prompts): see below at `wide_kernel`.
// * Tiles (2 to 4 tokens, and the tails): 2 groups (8 rows) per pass. Per block the weights of both groups are
//   loaded (4-bit ones unpacked) once into v0-v15 and reused by every token: 16 `sdot`s per token
//   into v28/v29 (zeroed by one load), then converted and scaled into the float accumulators.
//     v0-v7, v8-v15  group 0/1 weights, 8 vectors of 4 rows x 4 elements: v0-v3 (v8-v11) elements
//                    0..16, v4-v7 (v12-v15) elements 16..32 (4-bit: low/high nibbles, x16)
//     v16-v23        accumulators, token t in v(16+2t) (group 0) and v(17+2t) (group 1); formats
//                    with a second scale keep it in v22/v23 (so at most 3 tokens)
//     v24            0xF0 nibble mask (4-bit formats)
//     v25            lanes 2, 3: the token's activation d and s
//     v26, v27       the token's 32 activation quants
//     v28, v29       integer block dots
//     v30, v31       group 0/1 row scales d (f32)
// * Single token (decode): 4 groups (16 rows) per pass, sharing one activation load per block;
//   group g's dots go to v(20+g), its accumulator is v(16+g). After block 0 the blocks go in
//   pairs (Q4/Q8 load both blocks' row scales at once).
//
// Activations: one `ld1` of 48 bytes from 8 bytes before a block gets the previous block's tail,
// then d, s and the 32 quants: one load per token and block. Block 0 (where those 8 bytes may lie
// outside the row) is peeled and loaded in three instructions.

/// One kernel call: `units` passes (of 2 groups, or 4 for the single-token kernels) over
/// consecutive row groups starting at `wq`/`ws` (group strides `gq`/`gs` bytes: a stride of 0 runs
/// one group twice, for an odd tail), up to four tokens (activation rows `a`, outputs `o`: 4
/// floats per group and pass), `nb` blocks; `back` = the bytes an activation pointer advances per
/// pass (`40 nb - 8`).
struct Job {
    wq: *const u8,
    gq: usize,
    ws: *const u8,
    gs: usize,
    units: usize,
    nb: usize,
    back: usize,
    a: [*const ActBlock; 4],
    o: [*mut f32; 4],
}

type DotKernel = unsafe fn(&Job);

/// `{name}`: an asm operand reference for a macro-supplied operand name.
macro_rules! op {
    ($a:ident) => {
        concat!("{", stringify!($a), "}")
    };
}

#[rustfmt::skip]
macro_rules! act_load {
    (first, $a:ident) => { concat!(
        "ld1 {{v25.d}}[1], [", op!($a), "], #8\n",
        "ld1 {{v26.16b, v27.16b}}, [", op!($a), "], #32\n",
        "sub ", op!($a), ", ", op!($a), ", #8\n",
    ) };
    (steady, $a:ident) => { concat!(
        "ld1 {{v25.16b, v26.16b, v27.16b}}, [", op!($a), "], {c40}\n",
    ) };
}

/// 4 `sdot`s into `v$s` of weight vectors `v$w0..` with the 4 quant groups of `v$a`.
#[rustfmt::skip]
macro_rules! sdot4 { ($s:literal, $a:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal) => { concat!(
    "sdot v", $s, ".4s, v", $w0, ".16b, v", $a, ".4b[0]\n",
    "sdot v", $s, ".4s, v", $w1, ".16b, v", $a, ".4b[1]\n",
    "sdot v", $s, ".4s, v", $w2, ".16b, v", $a, ".4b[2]\n",
    "sdot v", $s, ".4s, v", $w3, ".16b, v", $a, ".4b[3]\n",
) } }

/// 4-bit unpack: low nibbles x16 in place (`v$w*`), high nibbles x16 into `v$h*`.
#[rustfmt::skip]
macro_rules! unpack4 { ($w0:literal, $w1:literal, $w2:literal, $w3:literal,
                        $h0:literal, $h1:literal, $h2:literal, $h3:literal) => { concat!(
    "and v", $h0, ".16b, v", $w0, ".16b, v24.16b\n",  "and v", $h1, ".16b, v", $w1, ".16b, v24.16b\n",
    "and v", $h2, ".16b, v", $w2, ".16b, v24.16b\n",  "and v", $h3, ".16b, v", $w3, ".16b, v24.16b\n",
    "shl v", $w0, ".16b, v", $w0, ".16b, #4\n",       "shl v", $w1, ".16b, v", $w1, ".16b, #4\n",
    "shl v", $w2, ".16b, v", $w2, ".16b, #4\n",       "shl v", $w3, ".16b, v", $w3, ".16b, #4\n",
) } }

/// Loads one group's block into `v$w0..v$w3` (64 bytes) from `$wq`.
#[rustfmt::skip]
macro_rules! ld4 { ($wq:ident, $w0:literal, $w1:literal, $w2:literal, $w3:literal) => { concat!(
    "ld1 {{v", $w0, ".16b, v", $w1, ".16b, v", $w2, ".16b, v", $w3, ".16b}}, [", op!($wq), "], #64\n",
) } }

// --- Tiles: 2 groups x up to 4 tokens ---

/// Both groups' block dots for the loaded token, into v28 (group 0) and v29 (group 1).
#[rustfmt::skip]
macro_rules! dots16 { () => { concat!(
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    "sdot v28.4s, v0.16b, v26.4b[0]\n",  "sdot v29.4s, v8.16b, v26.4b[0]\n",
    "sdot v28.4s, v1.16b, v26.4b[1]\n",  "sdot v29.4s, v9.16b, v26.4b[1]\n",
    "sdot v28.4s, v2.16b, v26.4b[2]\n",  "sdot v29.4s, v10.16b, v26.4b[2]\n",
    "sdot v28.4s, v3.16b, v26.4b[3]\n",  "sdot v29.4s, v11.16b, v26.4b[3]\n",
    "sdot v28.4s, v4.16b, v27.4b[0]\n",  "sdot v29.4s, v12.16b, v27.4b[0]\n",
    "sdot v28.4s, v5.16b, v27.4b[1]\n",  "sdot v29.4s, v13.16b, v27.4b[1]\n",
    "sdot v28.4s, v6.16b, v27.4b[2]\n",  "sdot v29.4s, v14.16b, v27.4b[2]\n",
    "sdot v28.4s, v7.16b, v27.4b[3]\n",  "sdot v29.4s, v15.16b, v27.4b[3]\n",
) } }

/// `F += (dot * d_w) * d_a` for both groups; `$cvt` is `", #4"` for 4-bit values (x16).
#[rustfmt::skip]
macro_rules! scale2 { ($f0:ident, $f1:ident, $cvt:literal) => { concat!(
    "scvtf v28.4s, v28.4s", $cvt, "\n",  "scvtf v29.4s, v29.4s", $cvt, "\n",
    "fmul v28.4s, v28.4s, v30.4s\n",     "fmul v29.4s, v29.4s, v31.4s\n",
    "fmla ", stringify!($f0), ".4s, v28.4s, v25.s[2]\n",
    "fmla ", stringify!($f1), ".4s, v29.4s, v25.s[2]\n",
) } }

/// `F += m * s_a` for both groups (mins in v22/v23).
#[rustfmt::skip]
macro_rules! min2 { ($f0:ident, $f1:ident) => { concat!(
    "fmla ", stringify!($f0), ".4s, v22.4s, v25.s[3]\n",
    "fmla ", stringify!($f1), ".4s, v23.4s, v25.s[3]\n",
) } }

#[rustfmt::skip]
macro_rules! tok_q4 { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ", #4"))
} }
#[rustfmt::skip]
macro_rules! tok_q8 { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ""))
} }
#[rustfmt::skip]
macro_rules! tok_q4m { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ", #4"), min2!($f0, $f1))
} }
#[rustfmt::skip]
macro_rules! tok_q8m { ($m:ident, $a:ident, $f0:ident, $f1:ident) => {
    concat!(act_load!($m, $a), dots16!(), scale2!($f0, $f1, ""), min2!($f0, $f1))
} }

/// Q8Sub16: per group, dots of elements 0..16 (v28) and 16..32 (v29) with their own scales
/// (v30/v31 and v22/v23).
#[rustfmt::skip]
macro_rules! tok_q8s { ($m:ident, $a:ident, $f0:ident, $f1:ident) => { concat!(
    act_load!($m, $a),
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    sdot4!("28", "26", "0", "1", "2", "3"),
    sdot4!("29", "27", "4", "5", "6", "7"),
    "scvtf v28.4s, v28.4s\n",            "scvtf v29.4s, v29.4s\n",
    "fmul v28.4s, v28.4s, v30.4s\n",     "fmla v28.4s, v29.4s, v22.4s\n",
    "fmla ", stringify!($f0), ".4s, v28.4s, v25.s[2]\n",
    "ld1 {{v28.16b, v29.16b}}, [{zp}]\n",
    sdot4!("28", "26", "8", "9", "10", "11"),
    sdot4!("29", "27", "12", "13", "14", "15"),
    "scvtf v28.4s, v28.4s\n",            "scvtf v29.4s, v29.4s\n",
    "fmul v28.4s, v28.4s, v31.4s\n",     "fmla v28.4s, v29.4s, v23.4s\n",
    "fmla ", stringify!($f1), ".4s, v28.4s, v25.s[2]\n",
) } }

#[rustfmt::skip]
macro_rules! wload4 { () => { concat!(
    ld4!(wq0, "0", "1", "2", "3"),       ld4!(wq1, "8", "9", "10", "11"),
    unpack4!("0", "1", "2", "3", "4", "5", "6", "7"),
    unpack4!("8", "9", "10", "11", "12", "13", "14", "15"),
) } }
#[rustfmt::skip]
macro_rules! wload8 { () => { concat!(
    ld4!(wq0, "0", "1", "2", "3"),       ld4!(wq0, "4", "5", "6", "7"),
    ld4!(wq1, "8", "9", "10", "11"),     ld4!(wq1, "12", "13", "14", "15"),
) } }
/// Row scales d of both groups (formats with one scale).
#[rustfmt::skip]
macro_rules! scales_d { () => { concat!(
    "ldr d30, [{ws0}], #8\n",            "ldr d31, [{ws1}], #8\n",
    "fcvtl v30.4s, v30.4h\n",            "fcvtl v31.4s, v31.4h\n",
) } }
/// Row scales d (v30/v31) and second scales (v22/v23) of both groups.
#[rustfmt::skip]
macro_rules! scales_dm { () => { concat!(
    "ldr q30, [{ws0}], #16\n",           "ldr q31, [{ws1}], #16\n",
    "fcvtl2 v22.4s, v30.8h\n",           "fcvtl2 v23.4s, v31.8h\n",
    "fcvtl v30.4s, v30.4h\n",            "fcvtl v31.4s, v31.4h\n",
) } }

#[rustfmt::skip]
macro_rules! grp_q4 { () => { concat!(wload4!(), scales_d!()) } }
#[rustfmt::skip]
macro_rules! grp_q8 { () => { concat!(wload8!(), scales_d!()) } }
/// Q4Min: the stored values are `nibble - 8`, so the min becomes `m + 8 d`.
#[rustfmt::skip]
macro_rules! grp_q4m { () => { concat!(
    wload4!(), scales_dm!(),
    "fmov v28.4s, #8.0\n",
    "fmla v22.4s, v30.4s, v28.4s\n",     "fmla v23.4s, v31.4s, v28.4s\n",
) } }
#[rustfmt::skip]
macro_rules! grp_q8m { () => { concat!(wload8!(), scales_dm!()) } }

#[rustfmt::skip]
macro_rules! mask { () => { "movi v24.16b, #0xf0\n" } }
#[rustfmt::skip]
macro_rules! nothing { () => { "" } }
/// Clears the accumulators (v16-v23, or v16-v21 where v22/v23 hold second scales).
#[rustfmt::skip]
macro_rules! zero8 { () => { concat!(
    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]\n",
    "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]\n",
) } }
#[rustfmt::skip]
macro_rules! zero6 { () => { concat!(
    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]\n",
    "ld1 {{v20.4s, v21.4s}}, [{zp}]\n",
) } }

/// Defines a tile kernel: `$init`, `$zero`, `$grp`, `$tok` name the format's pieces; one tuple
/// per token (index, pointer operand names, accumulator registers).
#[rustfmt::skip]
macro_rules! tile_kernel {
    ($name:ident, $init:ident, $zero:ident, $grp:ident, $tok:ident,
     [$( ($i:literal, $a:ident, $o:ident, $f0:ident, $f1:ident) ),+]) => {
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(job: &Job) {
            $( let $a = job.a[$i]; let $o = job.o[$i]; )+
            // SAFETY (caller's contract, see `Job`): the weight pointers address `units` pairs of
            // groups of `nb` blocks of quants and scales, each activation pointer `nb` blocks,
            // each output `8 units` writable floats; the CPU has dotprod. Every register written
            // is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "add {wq1}, {wq0}, {gq}",
                    "add {ws1}, {ws0}, {gs}",
                    "4:",
                    $zero!(),
                    "mov {n}, {nb}",
                    $grp!(),
                    $( $tok!(first, $a, $f0, $f1), )+
                    "subs {n}, {n}, #1",
                    "b.eq 3f",
                    "2:",
                    $grp!(),
                    $( $tok!(steady, $a, $f0, $f1), )+
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "3:",
                    $( concat!("st1 {{", stringify!($f0), ".4s, ", stringify!($f1), ".4s}}, [",
                               op!($o), "], #32"),
                       concat!("sub ", op!($a), ", ", op!($a), ", {back}"), )+
                    "mov {wq0}, {wq1}",
                    "add {wq1}, {wq1}, {gq}",
                    "mov {ws0}, {ws1}",
                    "add {ws1}, {ws1}, {gs}",
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq0 = inout(reg) job.wq => _,
                    wq1 = out(reg) _,
                    ws0 = inout(reg) job.ws => _,
                    ws1 = out(reg) _,
                    gq = in(reg) job.gq,
                    gs = in(reg) job.gs,
                    units = inout(reg) job.units => _,
                    nb = in(reg) job.nb,
                    n = out(reg) _,
                    back = in(reg) job.back,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    $( $a = inout(reg) $a => _, $o = inout(reg) $o => _, )+
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

/// The tile kernels of one format for 1, 2, 3 (and 4) tokens.
#[rustfmt::skip]
macro_rules! tile_kernels {
    ($init:ident, $zero:ident, $grp:ident, $tok:ident, $k1:ident, $k2:ident, $k3:ident) => {
        tile_kernel!($k1, $init, $zero, $grp, $tok, [(0, a0, o0, v16, v17)]);
        tile_kernel!($k2, $init, $zero, $grp, $tok, [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19)]);
        tile_kernel!($k3, $init, $zero, $grp, $tok,
            [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19), (2, a2, o2, v20, v21)]);
    };
    ($init:ident, $zero:ident, $grp:ident, $tok:ident, $k1:ident, $k2:ident, $k3:ident, $k4:ident) => {
        tile_kernels!($init, $zero, $grp, $tok, $k1, $k2, $k3);
        tile_kernel!($k4, $init, $zero, $grp, $tok,
            [(0, a0, o0, v16, v17), (1, a1, o1, v18, v19), (2, a2, o2, v20, v21), (3, a3, o3, v22, v23)]);
    };
}

tile_kernels!(mask, zero8, grp_q4, tok_q4, q4_t1, q4_t2, q4_t3, q4_t4);
tile_kernels!(nothing, zero8, grp_q8, tok_q8, q8_t1, q8_t2, q8_t3, q8_t4);
tile_kernels!(mask, zero6, grp_q4m, tok_q4m, q4m_t1, q4m_t2, q4m_t3);
tile_kernels!(nothing, zero6, grp_q8m, tok_q8m, q8m_t1, q8m_t2, q8m_t3);
tile_kernels!(nothing, zero6, grp_q8m, tok_q8s, q8s_t1, q8s_t2, q8s_t3);

// --- Single token: 4 groups ---

/// One group's 4-bit block into `v$w0..v$w7` and its 8 dots into `v$s`.
#[rustfmt::skip]
macro_rules! gv_w4 { ($wq:ident, $s:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal,
                      $w4:literal, $w5:literal, $w6:literal, $w7:literal) => { concat!(
    ld4!($wq, $w0, $w1, $w2, $w3),
    unpack4!($w0, $w1, $w2, $w3, $w4, $w5, $w6, $w7),
    sdot4!($s, "26", $w0, $w1, $w2, $w3),
    sdot4!($s, "27", $w4, $w5, $w6, $w7),
) } }
/// One group's 8-bit block into `v$w0..v$w7` and its 8 dots into `v$s`.
#[rustfmt::skip]
macro_rules! gv_w8 { ($wq:ident, $s:literal, $w0:literal, $w1:literal, $w2:literal, $w3:literal,
                      $w4:literal, $w5:literal, $w6:literal, $w7:literal) => { concat!(
    ld4!($wq, $w0, $w1, $w2, $w3),
    ld4!($wq, $w4, $w5, $w6, $w7),
    sdot4!($s, "26", $w0, $w1, $w2, $w3),
    sdot4!($s, "27", $w4, $w5, $w6, $w7),
) } }
/// Q8Sub16: one group's dots of elements 0..16 into `v$s` and 16..32 into `v$h`.
#[rustfmt::skip]
macro_rules! gv_w8s { ($wq:ident, $s:literal, $h:literal) => { concat!(
    ld4!($wq, "0", "1", "2", "3"),
    ld4!($wq, "4", "5", "6", "7"),
    sdot4!($s, "26", "0", "1", "2", "3"),
    sdot4!($h, "27", "4", "5", "6", "7"),
) } }

/// `F += (dot * d_w) * d_a` for one group (`$cvt` as in `scale2`).
#[rustfmt::skip]
macro_rules! gv_d { ($ws:ident, $s:literal, $f:literal, $cvt:literal) => { concat!(
    "ldr d28, [", op!($ws), "], #8\n",
    "fcvtl v28.4s, v28.4h\n",
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }
/// As `gv_d`, plus `F += m * s_a`; Q4Min (`$q4`) takes `m + 8 d` (8.0 in v30).
#[rustfmt::skip]
macro_rules! gv_dm { ($ws:ident, $s:literal, $f:literal, $cvt:literal, $q4:literal) => { concat!(
    "ldr q28, [", op!($ws), "], #16\n",
    "fcvtl2 v29.4s, v28.8h\n",
    "fcvtl v28.4s, v28.4h\n",
    $q4,
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
    "fmla v", $f, ".4s, v29.4s, v25.s[3]\n",
) } }
/// Q8Sub16: `F += (dot_lo * d_lo + dot_hi * d_hi) * d_a` for one group.
#[rustfmt::skip]
macro_rules! gv_ds { ($ws:ident, $s:literal, $h:literal, $f:literal) => { concat!(
    "ldr q28, [", op!($ws), "], #16\n",
    "fcvtl2 v29.4s, v28.8h\n",
    "fcvtl v28.4s, v28.4h\n",
    "scvtf v", $s, ".4s, v", $s, ".4s\n",
    "scvtf v", $h, ".4s, v", $h, ".4s\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $s, ".4s, v", $h, ".4s, v29.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }

#[rustfmt::skip]
macro_rules! zero_dots { () => { "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]\n" } }

#[rustfmt::skip]
macro_rules! gv_q4 { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w4!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w4!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_d!(ws0, "20", "16", ", #4"), gv_d!(ws1, "21", "17", ", #4"),
    gv_d!(ws2, "22", "18", ", #4"), gv_d!(ws3, "23", "19", ", #4"),
) } }
#[rustfmt::skip]
macro_rules! gv_q8 { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w8!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w8!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_d!(ws0, "20", "16", ""), gv_d!(ws1, "21", "17", ""),
    gv_d!(ws2, "22", "18", ""), gv_d!(ws3, "23", "19", ""),
) } }
#[rustfmt::skip]
macro_rules! gv_q4m { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w4!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w4!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w4!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_dm!(ws0, "20", "16", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws1, "21", "17", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws2, "22", "18", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
    gv_dm!(ws3, "23", "19", ", #4", "fmla v29.4s, v28.4s, v30.4s\n"),
) } }
#[rustfmt::skip]
macro_rules! gv_q8m { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    gv_w8!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq1, "21", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_w8!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_w8!(wq3, "23", "8", "9", "10", "11", "12", "13", "14", "15"),
    gv_dm!(ws0, "20", "16", "", ""), gv_dm!(ws1, "21", "17", "", ""),
    gv_dm!(ws2, "22", "18", "", ""), gv_dm!(ws3, "23", "19", "", ""),
) } }
#[rustfmt::skip]
macro_rules! gv_q8s { ($m:ident) => { concat!(
    act_load!($m, a0), zero_dots!(),
    "ld1 {{v8.4s, v9.4s, v10.4s, v11.4s}}, [{zp}]\n",
    gv_w8s!(wq0, "20", "8"), gv_w8s!(wq1, "21", "9"),
    gv_w8s!(wq2, "22", "10"), gv_w8s!(wq3, "23", "11"),
    gv_ds!(ws0, "20", "8", "16"), gv_ds!(ws1, "21", "9", "17"),
    gv_ds!(ws2, "22", "10", "18"), gv_ds!(ws3, "23", "11", "19"),
) } }

/// `F += (dot * d_w) * d_a` for one group, its row scales converted by `$cv` into v28.
#[rustfmt::skip]
macro_rules! gv_dx { ($cv:literal, $s:literal, $f:literal, $cvt:literal) => { concat!(
    $cv,
    "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
    "fmul v", $s, ".4s, v", $s, ".4s, v28.4s\n",
    "fmla v", $f, ".4s, v", $s, ".4s, v25.s[2]\n",
) } }
/// Two blocks of Q4 (`$w` is `gv_w4`) or Q8 (`gv_w8`): one load of each group's row scales for both
/// blocks (v8-v11), the weights of every group in v0-v7.
#[rustfmt::skip]
macro_rules! gv_pair { ($w:ident, $cvt:literal) => { concat!(
    "ldr q8, [{ws0}], #16\n",           "ldr q9, [{ws1}], #16\n",
    "ldr q10, [{ws2}], #16\n",          "ldr q11, [{ws3}], #16\n",
    act_load!(steady, a0), zero_dots!(),
    $w!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq1, "21", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq3, "23", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_dx!("fcvtl v28.4s, v8.4h\n", "20", "16", $cvt), gv_dx!("fcvtl v28.4s, v9.4h\n", "21", "17", $cvt),
    gv_dx!("fcvtl v28.4s, v10.4h\n", "22", "18", $cvt), gv_dx!("fcvtl v28.4s, v11.4h\n", "23", "19", $cvt),
    act_load!(steady, a0), zero_dots!(),
    $w!(wq0, "20", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq1, "21", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq2, "22", "0", "1", "2", "3", "4", "5", "6", "7"),
    $w!(wq3, "23", "0", "1", "2", "3", "4", "5", "6", "7"),
    gv_dx!("fcvtl2 v28.4s, v8.8h\n", "20", "16", $cvt), gv_dx!("fcvtl2 v28.4s, v9.8h\n", "21", "17", $cvt),
    gv_dx!("fcvtl2 v28.4s, v10.8h\n", "22", "18", $cvt), gv_dx!("fcvtl2 v28.4s, v11.8h\n", "23", "19", $cvt),
) } }
#[rustfmt::skip]
macro_rules! gv2_q4 { () => { gv_pair!(gv_w4, ", #4") } }
#[rustfmt::skip]
macro_rules! gv2_q8 { () => { gv_pair!(gv_w8, "") } }
#[rustfmt::skip]
macro_rules! gv2_q4m { () => { concat!(gv_q4m!(steady), gv_q4m!(steady)) } }
#[rustfmt::skip]
macro_rules! gv2_q8m { () => { concat!(gv_q8m!(steady), gv_q8m!(steady)) } }
#[rustfmt::skip]
macro_rules! gv2_q8s { () => { concat!(gv_q8s!(steady), gv_q8s!(steady)) } }

#[rustfmt::skip]
macro_rules! mask8 { () => { concat!(mask!(), "fmov v30.4s, #8.0\n") } }

/// Defines a single-token kernel (4 groups per pass) from the format's block body `$body`.
#[rustfmt::skip]
macro_rules! gemv_kernel {
    ($name:ident, $init:ident, $body:ident, $pair:ident) => {
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(job: &Job) {
            // SAFETY (caller's contract, see `Job`): the weight pointers address `units` runs of
            // 4 groups of `nb` blocks of quants and scales, the activation pointer `nb` blocks,
            // the output `16 units` writable floats; the CPU has dotprod. Every register written
            // is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "add {wq1}, {wq0}, {gq}",
                    "add {wq2}, {wq1}, {gq}",
                    "add {wq3}, {wq2}, {gq}",
                    "add {ws1}, {ws0}, {gs}",
                    "add {ws2}, {ws1}, {gs}",
                    "add {ws3}, {ws2}, {gs}",
                    "4:",
                    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]",
                    "sub {n}, {nb}, #1",
                    $body!(first),
                    "tbz {n}, #0, 5f",
                    $body!(steady),
                    "sub {n}, {n}, #1",
                    "5:",
                    "cbz {n}, 3f",
                    "2:",
                    $pair!(),
                    "subs {n}, {n}, #2",
                    "b.ne 2b",
                    "3:",
                    "st1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{o0}], #64",
                    "sub {a0}, {a0}, {back}",
                    "mov {wq0}, {wq3}",
                    "add {wq1}, {wq0}, {gq}",
                    "add {wq2}, {wq1}, {gq}",
                    "add {wq3}, {wq2}, {gq}",
                    "mov {ws0}, {ws3}",
                    "add {ws1}, {ws0}, {gs}",
                    "add {ws2}, {ws1}, {gs}",
                    "add {ws3}, {ws2}, {gs}",
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq0 = inout(reg) job.wq => _,
                    wq1 = out(reg) _,
                    wq2 = out(reg) _,
                    wq3 = out(reg) _,
                    ws0 = inout(reg) job.ws => _,
                    ws1 = out(reg) _,
                    ws2 = out(reg) _,
                    ws3 = out(reg) _,
                    gq = in(reg) job.gq,
                    gs = in(reg) job.gs,
                    units = inout(reg) job.units => _,
                    nb = in(reg) job.nb,
                    n = out(reg) _,
                    back = in(reg) job.back,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    a0 = inout(reg) job.a[0] => _,
                    o0 = inout(reg) job.o[0] => _,
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

gemv_kernel!(q4_gemv, mask, gv_q4, gv2_q4);
gemv_kernel!(q8_gemv, nothing, gv_q8, gv2_q8);
gemv_kernel!(q4m_gemv, mask8, gv_q4m, gv2_q4m);
gemv_kernel!(q8m_gemv, nothing, gv_q8m, gv2_q8m);
gemv_kernel!(q8s_gemv, nothing, gv_q8s, gv2_q8s);

// --- Wide tiles: 1 group x 16 tokens ---
//
// For prompts: the group's weights (v0-v7, unpacked once per block) serve 16 tokens, whose
// accumulators fill v16-v31. v8-v10 hold the token's activation block (d in v8.s[2], s in
// v8.s[3]); the integer dots rotate through v11-v13 (Q4), v11-v14 (Q8) or v11-v12 (Q4Min, Q8Min),
// zeroed by one load per 3, 4 or 2 tokens (Q8Sub16: v11/v12 for the two halves, every token).
// Row scales: v14 with the mask in v15 (Q4), v15 (Q8), v13 with the mins or second scales in v14
// (the rest; Q4Min's mask in v15).

/// Activation block of token `$a` into v8-v10 (as `act_load`).
#[rustfmt::skip]
macro_rules! wact_load {
    (first, $a:ident) => { concat!(
        "ld1 {{v8.d}}[1], [", op!($a), "], #8\n",
        "ld1 {{v9.16b, v10.16b}}, [", op!($a), "], #32\n",
        "sub ", op!($a), ", ", op!($a), ", #8\n",
    ) };
    (steady, $a:ident) => { concat!(
        "ld1 {{v8.16b, v9.16b, v10.16b}}, [", op!($a), "], {c40}\n",
    ) };
}

/// One token: `$z` (a zeroing load or nothing), the block's 8 dots into `v$s`, scaled into `v$f`.
#[rustfmt::skip]
macro_rules! wtok {
    ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal, $cvt:literal, $d:literal) => { concat!(
        $z,
        wact_load!($m, $a),
        sdot4!($s, "9", "0", "1", "2", "3"),
        sdot4!($s, "10", "4", "5", "6", "7"),
        "scvtf v", $s, ".4s, v", $s, ".4s", $cvt, "\n",
        "fmul v", $s, ".4s, v", $s, ".4s, v", $d, ".4s\n",
        "fmla v", $f, ".4s, v", $s, ".4s, v8.s[2]\n",
    ) };
}
#[rustfmt::skip]
macro_rules! wtok_q4 { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => {
    wtok!($m, $a, $f, $s, $z, ", #4", "14")
} }
#[rustfmt::skip]
macro_rules! wtok_q8 { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => {
    wtok!($m, $a, $f, $s, $z, "", "15")
} }
#[rustfmt::skip]
macro_rules! wgrp_q4 { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    "and v4.16b, v0.16b, v15.16b\n",     "and v5.16b, v1.16b, v15.16b\n",
    "and v6.16b, v2.16b, v15.16b\n",     "and v7.16b, v3.16b, v15.16b\n",
    "shl v0.16b, v0.16b, #4\n",          "shl v1.16b, v1.16b, #4\n",
    "shl v2.16b, v2.16b, #4\n",          "shl v3.16b, v3.16b, #4\n",
    "ldr d14, [{ws}], #8\n",
    "fcvtl v14.4s, v14.4h\n",
) } }
#[rustfmt::skip]
macro_rules! wgrp_q8 { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    ld4!(wq, "4", "5", "6", "7"),
    "ldr d15, [{ws}], #8\n",
    "fcvtl v15.4s, v15.4h\n",
) } }
#[rustfmt::skip]
macro_rules! wmask_q4 { () => { "movi v15.16b, #0xf0\n" } }

/// Defines a wide kernel; one tuple per token (index, pointer operand, accumulator, dot register,
/// zeroing load, output slot offset).
#[rustfmt::skip]
macro_rules! wide_kernel {
    ($name:ident, $init:ident, $grp:ident, $tok:ident,
     [$( ($i:literal, $a:ident, $f:literal, $s:literal, $z:literal, $off:literal) ),+]) => {
        /// # Safety
        /// `wq`/`ws` address `units` consecutive groups of `nb = slots[16]` blocks of quants and
        /// scales; `acts` 16 rows of `nb` blocks; `slots[t]` (t < 16) the address of `4 units`
        /// writable floats; `slots[17] = 40 nb - 8`; the CPU has dotprod.
        #[target_feature(enable = "dotprod")]
        unsafe fn $name(wq: *const u8, ws: *const u8, units: usize, acts: &[*const ActBlock; 16], slots: &[usize; 18]) {
            $( let $a = acts[$i]; )+
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    $init!(),
                    "mov {goff}, #0",
                    "4:",
                    "ld1 {{v16.4s, v17.4s, v18.4s, v19.4s}}, [{zp}]",
                    "ld1 {{v20.4s, v21.4s, v22.4s, v23.4s}}, [{zp}]",
                    "ld1 {{v24.4s, v25.4s, v26.4s, v27.4s}}, [{zp}]",
                    "ld1 {{v28.4s, v29.4s, v30.4s, v31.4s}}, [{zp}]",
                    "ldr {n}, [{slots}, #128]",
                    $grp!(),
                    $( $tok!(first, $a, $f, $s, $z), )+
                    "subs {n}, {n}, #1",
                    "b.eq 3f",
                    "2:",
                    $grp!(),
                    $( $tok!(steady, $a, $f, $s, $z), )+
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    "3:",
                    $( concat!("ldr {tmp}, [{slots}, #", $off, "]"),
                       concat!("str q", $f, ", [{tmp}, {goff}]"), )+
                    "add {goff}, {goff}, #16",
                    "ldr {tmp}, [{slots}, #136]",
                    $( concat!("sub ", op!($a), ", ", op!($a), ", {tmp}"), )+
                    "subs {units}, {units}, #1",
                    "b.ne 4b",
                    wq = inout(reg) wq => _,
                    ws = inout(reg) ws => _,
                    units = inout(reg) units => _,
                    slots = in(reg) slots.as_ptr(),
                    goff = out(reg) _,
                    tmp = out(reg) _,
                    n = out(reg) _,
                    zp = in(reg) ZEROS.as_ptr(),
                    c40 = in(reg) core::mem::size_of::<ActBlock>(),
                    $( $a = inout(reg) $a => _, )+
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

type WideKernel = unsafe fn(*const u8, *const u8, usize, &[*const ActBlock; 16], &[usize; 18]);

#[rustfmt::skip]
wide_kernel!(q4_wide, wmask_q4, wgrp_q4, wtok_q4, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "13", "", "16"),
    (3, a3, "19", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "24"),
    (4, a4, "20", "12", "", "32"),
    (5, a5, "21", "13", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "13", "", "64"),
    (9, a9, "25", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "72"),
    (10, a10, "26", "12", "", "80"),
    (11, a11, "27", "13", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b, v13.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "13", "", "112"),
    (15, a15, "31", "11", "ld1 {{v11.16b}}, [{zp}]\n", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8_wide, nothing, wgrp_q8, wtok_q8, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "13", "", "16"),
    (3, a3, "19", "14", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "13", "", "48"),
    (7, a7, "23", "14", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "13", "", "80"),
    (11, a11, "27", "14", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b, v13.16b, v14.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "13", "", "112"),
    (15, a15, "31", "14", "", "120")
]);

/// Q4Min / Q8Min: as `wtok`, plus `F += m * s_a` (min in v14, row scales in v13).
#[rustfmt::skip]
macro_rules! wtok_q4m { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    wtok!($m, $a, $f, $s, $z, ", #4", "13"),
    "fmla v", $f, ".4s, v14.4s, v8.s[3]\n",
) } }
#[rustfmt::skip]
macro_rules! wtok_q8m { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    wtok!($m, $a, $f, $s, $z, "", "13"),
    "fmla v", $f, ".4s, v14.4s, v8.s[3]\n",
) } }
/// Q8Sub16: dots of elements 0..16 into v11 and 16..32 into v12, scales in v13 and v14.
#[rustfmt::skip]
macro_rules! wtok_q8s { ($m:ident, $a:ident, $f:literal, $s:literal, $z:literal) => { concat!(
    "ld1 {{v11.16b, v12.16b}}, [{zp}]\n",
    wact_load!($m, $a),
    sdot4!("11", "9", "0", "1", "2", "3"),
    sdot4!("12", "10", "4", "5", "6", "7"),
    "scvtf v11.4s, v11.4s\n",            "scvtf v12.4s, v12.4s\n",
    "fmul v11.4s, v11.4s, v13.4s\n",     "fmla v11.4s, v12.4s, v14.4s\n",
    "fmla v", $f, ".4s, v11.4s, v8.s[2]\n",
) } }
/// Row scales (v13) and mins or second scales (v14) of one group.
#[rustfmt::skip]
macro_rules! wscales_dm { () => { concat!(
    "ldr q13, [{ws}], #16\n",
    "fcvtl2 v14.4s, v13.8h\n",
    "fcvtl v13.4s, v13.4h\n",
) } }
/// Q4Min: the min becomes `m + 8 d`.
#[rustfmt::skip]
macro_rules! wgrp_q4m { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    "and v4.16b, v0.16b, v15.16b\n",     "and v5.16b, v1.16b, v15.16b\n",
    "and v6.16b, v2.16b, v15.16b\n",     "and v7.16b, v3.16b, v15.16b\n",
    "shl v0.16b, v0.16b, #4\n",          "shl v1.16b, v1.16b, #4\n",
    "shl v2.16b, v2.16b, #4\n",          "shl v3.16b, v3.16b, #4\n",
    wscales_dm!(),
    "fmov v11.4s, #8.0\n",
    "fmla v14.4s, v13.4s, v11.4s\n",
) } }
#[rustfmt::skip]
macro_rules! wgrp_q8m { () => { concat!(
    ld4!(wq, "0", "1", "2", "3"),
    ld4!(wq, "4", "5", "6", "7"),
    wscales_dm!(),
) } }

#[rustfmt::skip]
wide_kernel!(q4m_wide, wmask_q4, wgrp_q4m, wtok_q4m, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "16"),
    (3, a3, "19", "12", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "80"),
    (11, a11, "27", "12", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "112"),
    (15, a15, "31", "12", "", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8m_wide, nothing, wgrp_q8m, wtok_q8m, [
    (0, a0, "16", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "0"),
    (1, a1, "17", "12", "", "8"),
    (2, a2, "18", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "16"),
    (3, a3, "19", "12", "", "24"),
    (4, a4, "20", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "32"),
    (5, a5, "21", "12", "", "40"),
    (6, a6, "22", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "48"),
    (7, a7, "23", "12", "", "56"),
    (8, a8, "24", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "64"),
    (9, a9, "25", "12", "", "72"),
    (10, a10, "26", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "80"),
    (11, a11, "27", "12", "", "88"),
    (12, a12, "28", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "96"),
    (13, a13, "29", "12", "", "104"),
    (14, a14, "30", "11", "ld1 {{v11.16b, v12.16b}}, [{zp}]\n", "112"),
    (15, a15, "31", "12", "", "120")
]);
#[rustfmt::skip]
wide_kernel!(q8s_wide, nothing, wgrp_q8m, wtok_q8s, [
    (0, a0, "16", "", "", "0"), (1, a1, "17", "", "", "8"),
    (2, a2, "18", "", "", "16"), (3, a3, "19", "", "", "24"),
    (4, a4, "20", "", "", "32"), (5, a5, "21", "", "", "40"),
    (6, a6, "22", "", "", "48"), (7, a7, "23", "", "", "56"),
    (8, a8, "24", "", "", "64"), (9, a9, "25", "", "", "72"),
    (10, a10, "26", "", "", "80"), (11, a11, "27", "", "", "88"),
    (12, a12, "28", "", "", "96"), (13, a13, "29", "", "", "104"),
    (14, a14, "30", "", "", "112"), (15, a15, "31", "", "", "120")
]);

/// Row groups per chunk: a chunk's weights stay in cache while every token tile passes over them.
const CHUNK_GROUPS: usize = 32;

/// Packed matmul with `sdot`: one token runs 16 rows per pass; more run 4 rows x 16 tokens while
/// 16 are left, then tiles of 8 rows x up to 4 tokens (3 for the two-scale formats).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub unsafe fn matmul_dotprod(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
) {
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    let (gemv, tiles): (DotKernel, &[DotKernel]) = match w.format {
        PackedFormat::Q4 => (q4_gemv, &[q4_t1, q4_t2, q4_t3, q4_t4]),
        PackedFormat::Q8 => (q8_gemv, &[q8_t1, q8_t2, q8_t3, q8_t4]),
        PackedFormat::Q4Min => (q4m_gemv, &[q4m_t1, q4m_t2, q4m_t3]),
        PackedFormat::Q8Min => (q8m_gemv, &[q8m_t1, q8m_t2, q8m_t3]),
        PackedFormat::Q8Sub16 => (q8s_gemv, &[q8s_t1, q8s_t2, q8s_t3]),
    };
    let wide: WideKernel = match w.format {
        PackedFormat::Q4 => q4_wide,
        PackedFormat::Q8 => q8_wide,
        PackedFormat::Q4Min => q4m_wide,
        PackedFormat::Q8Min => q8m_wide,
        PackedFormat::Q8Sub16 => q8s_wide,
    };
    let nb = w.blocks();
    let (gq, gs) = (nb * w.format.quant_bytes(), nb * w.format.scale_bytes());
    // What an activation pointer advances per pass (see `act_load`).
    let back = nb * core::mem::size_of::<ActBlock>() - 8;
    let mut slots = [0usize; 18];
    (slots[16], slots[17]) = (nb, back);
    let mut spare = [[0f32; 2 * GROUP_ROWS]; 4];
    let mut g = groups.start;
    while g < groups.end {
        let left = groups.end - g;
        // Single token: runs of 4 groups; else (and for the rest) pairs; an odd last group runs
        // as a pair with itself, its copy's outputs going to `spare`.
        let quads = n == 1 && left >= 4;
        let count = if quads { left - left % 4 } else { (left - left % 2).max(1) };
        // Chunks only pay when several token tiles pass over the weights.
        let count = if n > 4 { count.min(CHUNK_GROUPS) } else { count };
        let single = count == 1;
        let gi = g - groups.start;
        let mut t = 0;
        // Whole groups of 16 tokens, over the whole run of groups.
        while n - t >= 16 {
            let a: [*const ActBlock; 16] = core::array::from_fn(|i| acts[t + i].as_ptr());
            for (s, o) in slots.iter_mut().zip(&mut outs[t..t + 16]) {
                *s = o[GROUP_ROWS * gi..GROUP_ROWS * (gi + count)].as_mut_ptr() as usize;
            }
            // SAFETY: `matmul_tokens` checked the planes (`count` groups of `nb` blocks from
            // `g`), the activation rows (>= nb blocks) and the output rows (the `4 count`
            // floats at `4 gi` exist); the CPU has dotprod (this function's contract).
            unsafe { wide(w.quants[g * gq..].as_ptr(), w.scales[g * gs..].as_ptr(), count, &a, &slots) };
            t += 16;
        }
        while t < n {
            let (kernel, tn) = if quads {
                (gemv, 1)
            } else {
                let tn = (n - t).min(tiles.len());
                (tiles[tn - 1], tn)
            };
            let mut job = Job {
                wq: w.quants[g * gq..].as_ptr(),
                gq: if single { 0 } else { gq },
                ws: w.scales[g * gs..].as_ptr(),
                gs: if single { 0 } else { gs },
                units: if quads { count / 4 } else { count.div_ceil(2) },
                nb,
                back,
                a: [core::ptr::null(); 4],
                o: [core::ptr::null_mut(); 4],
            };
            for (i, s) in spare.iter_mut().enumerate().take(tn) {
                job.a[i] = acts[t + i].as_ptr();
                job.o[i] = if single {
                    s.as_mut_ptr()
                } else {
                    outs[t + i][GROUP_ROWS * gi..GROUP_ROWS * (gi + count)].as_mut_ptr()
                };
            }
            // SAFETY: `matmul_tokens` checked the planes (consistent, groups in range: `count`
            // groups of `nb` blocks from `g`) and every activation (>= nb blocks) and output row
            // (the `4 count` floats at `4 gi` exist; `spare` takes the 8 of a doubled group); the
            // CPU has dotprod (this function's contract).
            unsafe { kernel(&job) };
            if single {
                for (i, s) in spare.iter().enumerate().take(tn) {
                    outs[t + i][GROUP_ROWS * gi..GROUP_ROWS * (gi + 1)].copy_from_slice(&s[..GROUP_ROWS]);
                }
            }
            t += tn;
        }
        g += count;
    }
}

// ---------------------------------------------------------------------------------------------
// Packed matmul without `sdot` (A55/A72-class cores)

/// Packed matmul without the dot-product extension: per 4 activation quants broadcast over the 4
/// rows, `smull`/`smlal` pairs of int8 products into int16 (two products of |16 q| <= 128 and
/// |a| <= 127 fit), `sadalp` into int32. One token runs 4 groups per pass (sharing the
/// broadcasts), several run 1 group x 4 tokens (sharing the unpacked weights).
pub fn matmul(w: &PackedMatrix<'_>, groups: Range<usize>, acts: &[&[ActBlock]], outs: &mut [&mut [f32]]) {
    let Some(n) = matmul_tokens(w, &groups, acts, outs) else { return };
    // SAFETY (each arm): NEON is part of the aarch64 baseline.
    match w.format {
        PackedFormat::Q4 => unsafe { matmul_neon::<FMT_Q4>(w, groups, acts, outs, n) },
        PackedFormat::Q4Min => unsafe { matmul_neon::<FMT_Q4MIN>(w, groups, acts, outs, n) },
        PackedFormat::Q8 => unsafe { matmul_neon::<FMT_Q8>(w, groups, acts, outs, n) },
        PackedFormat::Q8Min => unsafe { matmul_neon::<FMT_Q8MIN>(w, groups, acts, outs, n) },
        PackedFormat::Q8Sub16 => unsafe { matmul_neon::<FMT_Q8SUB16>(w, groups, acts, outs, n) },
    }
}

// The formats as const parameters, so each gets its own inner loops.
const FMT_Q4: u8 = 0;
const FMT_Q4MIN: u8 = 1;
const FMT_Q8: u8 = 2;
const FMT_Q8MIN: u8 = 3;
const FMT_Q8SUB16: u8 = 4;

#[target_feature(enable = "neon")]
fn matmul_neon<const F: u8>(
    w: &PackedMatrix<'_>,
    groups: Range<usize>,
    acts: &[&[ActBlock]],
    outs: &mut [&mut [f32]],
    n: usize,
) {
    let nb = w.blocks();
    let mut g = groups.start;
    if n == 1 {
        let (act, out) = (acts[0], &mut *outs[0]);
        while groups.end - g >= 4 {
            let planes = core::array::from_fn(|i| (w.group_quants(g + i), w.group_scales(g + i)));
            let f = groups_gemv::<F>(planes, act, nb);
            st_f32x16(&mut out[GROUP_ROWS * (g - groups.start)..], f);
            g += 4;
        }
    }
    for g in g..groups.end {
        let (q, s) = (w.group_quants(g), w.group_scales(g));
        let gi = g - groups.start;
        let mut t = 0;
        while t < n {
            if let Ok(a) = <&[&[ActBlock]; 4]>::try_from(&acts[t..n.min(t + 4)]) {
                let f = group_tokens::<F, 4>(q, s, a, nb);
                for (f, o) in f.iter().zip(outs[t..t + 4].iter_mut()) {
                    st_f32x4(&mut o[GROUP_ROWS * gi..], *f);
                }
                t += 4;
            } else {
                let [f] = group_tokens::<F, 1>(q, s, &[acts[t]], nb);
                st_f32x4(&mut outs[t][GROUP_ROWS * gi..], f);
                t += 1;
            }
        }
    }
}

/// One token against 4 groups (their quant and scale planes): the activation broadcasts are
/// shared by the groups.
#[target_feature(enable = "neon")]
#[inline]
fn groups_gemv<const F: u8>(planes: [(&[u8], &[u8]); 4], act: &[ActBlock], nb: usize) -> [float32x4_t; 4] {
    let (qb, sb) = block_bytes::<F>();
    let mut f = [vdupq_n_f32(0.0); 4];
    for (b, a) in act[..nb].iter().enumerate() {
        let x = broadcasts(a);
        for (f, (q, s)) in f.iter_mut().zip(planes) {
            let wv = weights::<F>(&q[b * qb..(b + 1) * qb]);
            let (d, m) = scales::<F>(&s[b * sb..(b + 1) * sb]);
            *f = accumulate::<F>(*f, &wv, &x, d, m, a);
        }
    }
    f
}

/// Quant and scale bytes per group and block of format `F`.
const fn block_bytes<const F: u8>() -> (usize, usize) {
    match F {
        FMT_Q4 => (64, 8),
        FMT_Q4MIN => (64, 16),
        FMT_Q8 => (128, 8),
        _ => (128, 16),
    }
}

/// One group against `T` tokens: the unpacked weights are shared by the tokens.
#[target_feature(enable = "neon")]
#[inline]
fn group_tokens<const F: u8, const T: usize>(
    q: &[u8],
    s: &[u8],
    acts: &[&[ActBlock]; T],
    nb: usize,
) -> [float32x4_t; T] {
    let (qb, sb) = block_bytes::<F>();
    let mut f = [vdupq_n_f32(0.0); T];
    for b in 0..nb {
        let wv = weights::<F>(&q[b * qb..(b + 1) * qb]);
        let (d, m) = scales::<F>(&s[b * sb..(b + 1) * sb]);
        for (f, act) in f.iter_mut().zip(acts) {
            let a = &act[b];
            *f = accumulate::<F>(*f, &wv, &broadcasts(a), d, m, a);
        }
    }
    f
}

/// A group's block as 8 vectors of 4 rows x 4 elements (elements 0..16, then 16..32; 4-bit
/// values x16).
#[target_feature(enable = "neon")]
#[inline]
fn weights<const F: u8>(wq: &[u8]) -> [int8x16_t; 8] {
    if F == FMT_Q4 || F == FMT_Q4MIN {
        let mask = vdupq_n_s8(0xF0u8 as i8);
        let x: [int8x16_t; 4] = core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]));
        core::array::from_fn(|c| if c < 4 { vshlq_n_s8::<4>(x[c]) } else { vandq_s8(x[c - 4], mask) })
    } else {
        core::array::from_fn(|c| ld_s8x16(&wq[16 * c..]))
    }
}

/// A group's row scales `d` and second scales (`m`, `m + 8 d` for Q4Min, or the scales of
/// elements 16..32).
#[target_feature(enable = "neon")]
#[inline]
fn scales<const F: u8>(sc: &[u8]) -> (float32x4_t, float32x4_t) {
    let d = f16x4_to_f32(&sc[..8]);
    if F == FMT_Q4 || F == FMT_Q8 {
        return (d, d);
    }
    let m = f16x4_to_f32(&sc[8..16]);
    (d, if F == FMT_Q4MIN { vfmaq_n_f32(m, d, 8.0) } else { m })
}

/// The 8 groups of 4 activation quants, each broadcast over a vector.
#[target_feature(enable = "neon")]
#[inline]
fn broadcasts(a: &ActBlock) -> [int8x16_t; 8] {
    let (lo, hi) = (vreinterpretq_s32_s8(ld_i8x16(&a.qs[..16])), vreinterpretq_s32_s8(ld_i8x16(&a.qs[16..])));
    let b = |v: int32x4_t| vreinterpretq_s8_s32(v);
    [
        b(vdupq_laneq_s32::<0>(lo)),
        b(vdupq_laneq_s32::<1>(lo)),
        b(vdupq_laneq_s32::<2>(lo)),
        b(vdupq_laneq_s32::<3>(lo)),
        b(vdupq_laneq_s32::<0>(hi)),
        b(vdupq_laneq_s32::<1>(hi)),
        b(vdupq_laneq_s32::<2>(hi)),
        b(vdupq_laneq_s32::<3>(hi)),
    ]
}

/// One block of one token added to the accumulator `f`.
#[target_feature(enable = "neon")]
#[inline]
fn accumulate<const F: u8>(
    f: float32x4_t,
    w: &[int8x16_t; 8],
    x: &[int8x16_t; 8],
    d: float32x4_t,
    m: float32x4_t,
    a: &ActBlock,
) -> float32x4_t {
    // Per pair of weight vectors: rows 0, 1 (low halves) and rows 2, 3 (high halves) as int16.
    let p: [(int16x8_t, int16x8_t); 4] =
        core::array::from_fn(|i| mul_pair(w[2 * i], w[2 * i + 1], x[2 * i], x[2 * i + 1]));
    // Pairwise sums into [r0, r0, r1, r1] and [r2, r2, r3, r3], then one lane per row.
    let half = |p: &[(int16x8_t, int16x8_t)]| {
        let lo = vpadalq_s16(vpaddlq_s16(p[0].0), p[1].0);
        let hi = vpadalq_s16(vpaddlq_s16(p[0].1), p[1].1);
        (lo, hi)
    };
    if F == FMT_Q8SUB16 {
        let ((l0, h0), (l1, h1)) = (half(&p[..2]), half(&p[2..]));
        let x = vmulq_f32(vcvtq_f32_s32(vpaddq_s32(l0, h0)), d);
        let x = vfmaq_f32(x, vcvtq_f32_s32(vpaddq_s32(l1, h1)), m);
        return vfmaq_n_f32(f, x, a.d);
    }
    let (lo, hi) = half(&p[..2]);
    let (lo, hi) =
        (vpadalq_s16(vpadalq_s16(lo, p[2].0), p[3].0), vpadalq_s16(vpadalq_s16(hi, p[2].1), p[3].1));
    let dot = vpaddq_s32(lo, hi);
    let dot = if F == FMT_Q4 || F == FMT_Q4MIN { vcvtq_n_f32_s32::<4>(dot) } else { vcvtq_f32_s32(dot) };
    let f = vfmaq_n_f32(f, vmulq_f32(dot, d), a.d);
    if F == FMT_Q4MIN || F == FMT_Q8MIN {
        vfmaq_n_f32(f, m, a.s)
    } else {
        f
    }
}

/// `w0 * x0 + w1 * x1` per byte lane as int16: low halves (rows 0, 1) and high halves (rows 2, 3).
#[inline(always)]
fn mul_pair(w0: int8x16_t, w1: int8x16_t, x0: int8x16_t, x1: int8x16_t) -> (int16x8_t, int16x8_t) {
    let (lo, hi): (int16x8_t, int16x8_t);
    // SAFETY: register-only arithmetic (base AdvSIMD).
    unsafe {
        asm!(
            "smull {lo:v}.8h, {w0:v}.8b, {x0:v}.8b",
            "smull2 {hi:v}.8h, {w0:v}.16b, {x0:v}.16b",
            "smlal {lo:v}.8h, {w1:v}.8b, {x1:v}.8b",
            "smlal2 {hi:v}.8h, {w1:v}.16b, {x1:v}.16b",
            lo = out(vreg) lo, hi = out(vreg) hi,
            w0 = in(vreg) w0, w1 = in(vreg) w1, x0 = in(vreg) x0, x1 = in(vreg) x1,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    (lo, hi)
}

// ---------------------------------------------------------------------------------------------
// Small safe helpers

#[target_feature(enable = "neon")]
#[inline]
fn ld_s8x16(b: &[u8]) -> int8x16_t {
    let b: &[u8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_i8x16(b: &[i8]) -> int8x16_t {
    let b: &[i8; 16] = b[..16].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `b`.
    unsafe { vld1q_s8(b.as_ptr()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x4(x: &[f32]) -> float32x4_t {
    let x: &[f32; 4] = x[..4].try_into().unwrap();
    // SAFETY: reads the 4 floats of `x`.
    unsafe { vld1q_f32(x.as_ptr()) }
}

/// 16 floats as 4 vectors.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f32x16(x: &[f32]) -> [float32x4_t; 4] {
    let x: &[f32; 16] = x[..16].try_into().unwrap();
    // SAFETY: reads the 16 floats of `x`.
    let r = unsafe { vld1q_f32_x4(x.as_ptr()) };
    [r.0, r.1, r.2, r.3]
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x16(x: &mut [f32], v: [float32x4_t; 4]) {
    let x: &mut [f32; 16] = (&mut x[..16]).try_into().unwrap();
    // SAFETY: writes the 16 floats of `x`.
    unsafe { vst1q_f32_x4(x.as_mut_ptr(), float32x4x4_t(v[0], v[1], v[2], v[3])) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f32x4(x: &mut [f32], v: float32x4_t) {
    let x: &mut [f32; 4] = (&mut x[..4]).try_into().unwrap();
    // SAFETY: writes the 4 floats of `x`.
    unsafe { vst1q_f32(x.as_mut_ptr(), v) }
}

/// 8 f16 values (`F16Le`s or raw little-endian bytes) as raw bits.
#[target_feature(enable = "neon")]
#[inline]
fn ld_f16x8(x: &[F16Le]) -> uint16x8_t {
    let x: &[F16Le; 8] = x[..8].try_into().unwrap();
    // SAFETY: reads the 16 bytes of `x` (ld1 has no alignment requirement).
    unsafe { vld1q_u16(x.as_ptr().cast()) }
}

#[target_feature(enable = "neon")]
#[inline]
fn st_f16x8(x: &mut [F16Le], v: uint16x8_t) {
    let x: &mut [F16Le; 8] = (&mut x[..8]).try_into().unwrap();
    // SAFETY: writes the 16 bytes of `x`.
    unsafe { vst1q_u16(x.as_mut_ptr().cast(), v) }
}

/// Widens 4 f16 (8 little-endian bytes) to f32.
#[target_feature(enable = "neon")]
#[inline]
fn f16x4_to_f32(b: &[u8]) -> float32x4_t {
    let b: &[u8; 8] = b[..8].try_into().unwrap();
    // SAFETY: reads the 8 bytes of `b`.
    let h = unsafe { vld1_u16(b.as_ptr().cast()) };
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the low 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_lo(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl is base AdvSIMD).
    unsafe {
        asm!("fcvtl {r:v}.4s, {h:v}.4h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Widens the high 4 of 8 f16 (raw bits) to f32.
#[inline(always)]
fn f16_hi(h: uint16x8_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversion (fcvtl2 is base AdvSIMD).
    unsafe {
        asm!("fcvtl2 {r:v}.4s, {h:v}.8h", r = lateout(vreg) r, h = in(vreg) h, options(pure, nomem, nostack, preserves_flags))
    };
    r
}

/// Rounds 8 f32 to f16 (nearest even, as `F16Le::from_f32`), as raw bits.
#[inline(always)]
fn f16_narrow(lo: float32x4_t, hi: float32x4_t) -> uint16x8_t {
    let r: uint16x8_t;
    // SAFETY: register-only conversion (fcvtn/fcvtn2 are base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {lo:v}.4s",
            "fcvtn2 {r:v}.8h, {hi:v}.4s",
            r = out(vreg) r, lo = in(vreg) lo, hi = in(vreg) hi,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
}

/// Rounds 4 f32 to the nearest f16 value, kept as f32.
#[inline(always)]
fn f16_round4(x: float32x4_t) -> float32x4_t {
    let r: float32x4_t;
    // SAFETY: register-only conversions (base AdvSIMD).
    unsafe {
        asm!(
            "fcvtn {r:v}.4h, {x:v}.4s",
            "fcvtl {r:v}.4s, {r:v}.4h",
            r = out(vreg) r, x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    r
}

// ---------------------------------------------------------------------------------------------
// Activation quantization

/// Activation quantization; the same bytes as `packed::quantize_act_ref`.
pub fn quantize_act(x: &[f32], out: &mut [ActBlock]) {
    debug_assert_eq!(x.len(), out.len() * BLOCK);
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { quantize_act_neon(x, out) }
}

#[target_feature(enable = "neon")]
fn quantize_act_neon(x: &[f32], out: &mut [ActBlock]) {
    let zero = vdupq_n_f32(0.0);
    for (x, b) in x.chunks_exact(BLOCK).zip(out.iter_mut()) {
        let v: [float32x4_t; 8] = core::array::from_fn(|i| ld_f32x4(&x[4 * i..]));
        // max(0, |v|...) ignoring NaNs, like the reference's fold.
        let m = |a: float32x4_t, b: float32x4_t| vmaxnmq_f32(vabsq_f32(a), vabsq_f32(b));
        let m = vmaxnmq_f32(
            vmaxnmq_f32(m(v[0], v[1]), m(v[2], v[3])),
            vmaxnmq_f32(vmaxnmq_f32(m(v[4], v[5]), m(v[6], v[7])), zero),
        );
        let amax = vmaxnmvq_f32(m);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        if id == f32::INFINITY {
            // amax < 127 / f32::MAX: the products saturate, which the narrowing below would not.
            quantize_act_ref(x, core::slice::from_mut(b));
            continue;
        }
        // Round half to even, as rintf.
        let q: [int32x4_t; 8] = core::array::from_fn(|i| vcvtnq_s32_f32(vmulq_n_f32(v[i], id)));
        let h = |a: int32x4_t, b: int32x4_t| vuzp1q_s16(vreinterpretq_s16_s32(a), vreinterpretq_s16_s32(b));
        let h = [h(q[0], q[1]), h(q[2], q[3]), h(q[4], q[5]), h(q[6], q[7])];
        let sum = vaddlvq_s16(vaddq_s16(vaddq_s16(h[0], h[1]), vaddq_s16(h[2], h[3])));
        let lo = vuzp1q_s8(vreinterpretq_s8_s16(h[0]), vreinterpretq_s8_s16(h[1]));
        let hi = vuzp1q_s8(vreinterpretq_s8_s16(h[2]), vreinterpretq_s8_s16(h[3]));
        let (qlo, qhi) = b.qs.split_at_mut(16);
        // SAFETY: writes the 16 bytes of each half.
        unsafe {
            vst1q_s8(qlo.as_mut_ptr(), lo);
            vst1q_s8(qhi.as_mut_ptr(), hi);
        }
        let ds = vcombine_f32(vset_lane_f32::<1>(d * sum as f32, vdup_n_f32(d)), vdup_n_f32(0.0));
        let ds = f16_round4(ds);
        b.d = vgetq_lane_f32::<0>(ds);
        b.s = vgetq_lane_f32::<1>(ds);
    }
}

// ---------------------------------------------------------------------------------------------
// RMS norm, SwiGLU

/// RMS norm, bit-identical to `reference::rms_norm_ref` (squares in f32, summed in f64 in order).
pub fn rms_norm(x: &[f32], out: &mut [f32], eps: f32) {
    debug_assert_eq!(x.len(), out.len());
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rms_norm_neon(x, out, eps) }
}

#[target_feature(enable = "neon")]
fn rms_norm_neon(x: &[f32], out: &mut [f32], eps: f32) {
    let mut sum = 0f64;
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for v in [ld_f32x4(c), ld_f32x4(&c[4..])] {
            let sq = vmulq_f32(v, v);
            let (lo, hi) = (vcvt_f64_f32(vget_low_f32(sq)), vcvt_high_f64_f32(sq));
            sum += vgetq_lane_f64::<0>(lo);
            sum += vgetq_lane_f64::<1>(lo);
            sum += vgetq_lane_f64::<0>(hi);
            sum += vgetq_lane_f64::<1>(hi);
        }
    }
    for &v in tail {
        sum += f64::from(v * v);
    }
    let mean = (sum / x.len().max(1) as f64) as f32;
    let scale = 1.0 / libm::sqrtf(mean + eps);
    let n = x.len().min(out.len());
    let whole = n - n % 16;
    for (o, x) in out[..whole].chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        st_f32x16(o, ld_f32x16(x).map(|v| vmulq_n_f32(v, scale)));
    }
    for (o, &v) in out[whole..n].iter_mut().zip(&x[whole..n]) {
        *o = v * scale;
    }
}

/// `silu(gate) * up`, bit-identical to `reference::swiglu_ref`: ggml's exp polynomial with the
/// same fused steps and an exact 2^n scale; chunks with an input outside `|g| <= 86.5` (where
/// 2^n could leave the normal range) or a NaN take the scalar twin.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { swiglu_neon(gate, up, out) }
}

#[target_feature(enable = "neon")]
fn swiglu_neon(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let whole = n - n % 16;
    swiglu_chunks(&gate[..whole], &up[..whole], &mut out[..whole]);
    if whole < n {
        // The tail padded to 16 lanes; every lane is computed on its own.
        let (mut g, mut u, mut o) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        g[..n - whole].copy_from_slice(&gate[whole..n]);
        u[..n - whole].copy_from_slice(&up[whole..n]);
        swiglu_chunks(&g, &u, &mut o);
        out[whole..n].copy_from_slice(&o[..n - whole]);
    }
}

/// The constants of `reference::ggml_expf`, and the fast-path bound.
struct ExpConsts {
    shift: float32x4_t,
    log2e: float32x4_t,
    ln2_hi: float32x4_t,
    ln2_lo: float32x4_t,
    c: [float32x4_t; 5],
    one: float32x4_t,
    bound: float32x4_t,
}

/// SwiGLU over whole chunks of 16.
#[target_feature(enable = "neon")]
fn swiglu_chunks(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let k = |bits: u32| vdupq_n_f32(f32::from_bits(bits));
    let e = ExpConsts {
        shift: k(0x4b40_0000),
        log2e: k(0x3fb8_aa3b),
        ln2_hi: k(0x3f31_7200),
        ln2_lo: k(0x35bf_be8e),
        c: [k(0x3f7f_fff6), k(0x3eff_fedb), k(0x3e2a_af33), k(0x3d2b_9f17), k(0x3c07_2010)],
        one: vdupq_n_f32(1.0),
        // |g| <= 86.5 keeps |n| <= 125: j * 2^n stays normal, so adding n to j's exponent is exact.
        bound: vdupq_n_f32(86.5),
    };
    // Every chunk on the fast path (no calls in the loop: the constants stay in registers), then
    // the rare chunks with an input outside the bound again through the twin.
    let mut all = vdupq_n_u32(u32::MAX);
    for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
        let (gv, uv) = (ld_f32x16(g), ld_f32x16(u));
        let ok = vandq_u32(
            vandq_u32(vcaleq_f32(gv[0], e.bound), vcaleq_f32(gv[1], e.bound)),
            vandq_u32(vcaleq_f32(gv[2], e.bound), vcaleq_f32(gv[3], e.bound)),
        );
        all = vandq_u32(all, ok);
        st_f32x16(o, [0, 1, 2, 3].map(|i| silu_mul(&e, gv[i], uv[i])));
    }
    if vminvq_u32(all) == 0 {
        for ((o, g), u) in out.chunks_exact_mut(16).zip(gate.chunks_exact(16)).zip(up.chunks_exact(16)) {
            if g.iter().any(|g| g.is_nan() || g.abs() > 86.5) {
                swiglu_ref(g, u, o);
            }
        }
    }
}

/// `silu(g) * u` for 4 lanes with `|g| <= 86.5`: the steps of `reference::ggml_expf` (fused where
/// it uses fmaf) for `exp(-g)`.
#[target_feature(enable = "neon")]
#[inline]
fn silu_mul(e: &ExpConsts, g: float32x4_t, u: float32x4_t) -> float32x4_t {
    let x = vnegq_f32(g);
    let z = vfmaq_f32(e.shift, x, e.log2e);
    let n = vsubq_f32(z, e.shift);
    let b = vfmsq_f32(vfmsq_f32(x, n, e.ln2_hi), n, e.ln2_lo);
    let uu = vmulq_f32(b, b);
    let p = vfmaq_f32(e.c[3], e.c[4], b);
    let q = vfmaq_f32(e.c[1], e.c[2], b);
    let r = vfmaq_f32(e.one, e.c[0], b);
    let j = vfmaq_f32(r, vfmaq_f32(q, p, uu), uu);
    // z = 1.5 * 2^23 + n, so z's bits shifted left by 23 are n << 23: add it to j's exponent.
    let ex = vaddq_u32(vreinterpretq_u32_f32(j), vshlq_n_u32::<23>(vreinterpretq_u32_f32(z)));
    vmulq_f32(vdivq_f32(g, vaddq_f32(e.one, vreinterpretq_f32_u32(ex))), u)
}

// ---------------------------------------------------------------------------------------------
// f32 -> f16 rows

/// `reference::f32_to_f16_ref` 8 values at a time (`fcvtn` rounds to nearest even, like it).
pub fn f32_to_f16(x: &[f32], out: &mut [F16Le]) {
    let n = x.len().min(out.len());
    let n8 = n - n % 8;
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { f32_to_f16_neon(&x[..n8], &mut out[..n8]) };
    f32_to_f16_ref(&x[n8..n], &mut out[n8..n]);
}

#[target_feature(enable = "neon")]
fn f32_to_f16_neon(x: &[f32], out: &mut [F16Le]) {
    for (x, o) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
        st_f16x8(o, f16_narrow(ld_f32x4(x), ld_f32x4(&x[4..])));
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE

/// `reference::rope_rotate_ref` four pairs at a time (the same products and sums, unfused).
pub fn rope_rotate(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    if sin.len() != half || x.len() < 2 * half || out.len() != x.len() {
        return rope_rotate_ref(x, out, cos, sin, neox);
    }
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { rope_rotate_neon(x, out, cos, sin, neox) }
}

#[target_feature(enable = "neon")]
fn rope_rotate_neon(x: &[f32], out: &mut [f32], cos: &[f32], sin: &[f32], neox: bool) {
    let half = cos.len();
    let n4 = half - half % 4;
    for i in (0..n4).step_by(4) {
        let (c, s) = (ld_f32x4(&cos[i..]), ld_f32x4(&sin[i..]));
        if neox {
            let (x0, x1) = (ld_f32x4(&x[i..]), ld_f32x4(&x[half + i..]));
            st_f32x4(&mut out[i..], vsubq_f32(vmulq_f32(x0, c), vmulq_f32(x1, s)));
            st_f32x4(&mut out[half + i..], vaddq_f32(vmulq_f32(x0, s), vmulq_f32(x1, c)));
        } else {
            let xs: &[f32; 8] = x[2 * i..2 * i + 8].try_into().unwrap();
            // SAFETY: reads the 8 floats of `xs`.
            let v = unsafe { vld2q_f32(xs.as_ptr()) };
            let r = float32x4x2_t(
                vsubq_f32(vmulq_f32(v.0, c), vmulq_f32(v.1, s)),
                vaddq_f32(vmulq_f32(v.0, s), vmulq_f32(v.1, c)),
            );
            let o: &mut [f32; 8] = (&mut out[2 * i..2 * i + 8]).try_into().unwrap();
            // SAFETY: writes the 8 floats of `o`.
            unsafe { vst2q_f32(o.as_mut_ptr(), r) };
        }
    }
    for i in n4..half {
        let (c, s) = (cos[i], sin[i]);
        let (a, b) = if neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
        let (x0, x1) = (x[a], x[b]);
        out[a] = x0 * c - x1 * s;
        out[b] = x0 * s + x1 * c;
    }
    out[2 * half..].copy_from_slice(&x[2 * half..]);
}

// ---------------------------------------------------------------------------------------------
// Flash attention

/// Longest query/value row handled here (longer ones take the reference).
const MAX_HEAD: usize = 512;

/// One query row of flash attention over an f16 KV cache: `reference::flash_attn_row_ref`'s
/// steps with vector f16 conversions. The key dots are summed in f64 like the reference's (in
/// another order, which only matters if that sum rounds): a last-bit change of a score flips
/// greedy tokens on near-tie models (the tiny random test models do it).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_row<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    let (dk, dv) = (q.len(), out.len());
    if dk > MAX_HEAD || dk % 8 != 0 || dv % 8 != 0 || q16.len() < dk || acc16.len() < dv {
        return flash_attn_row_ref(q, q16, keys, key, value, scale, acc16, out);
    }
    let (q16, acc16) = (&mut q16[..dk], &mut acc16[..dv]);
    // SAFETY (each arm): NEON is part of the aarch64 baseline.
    match (dk, dv) {
        (64, 64) => unsafe { flash_attn_fixed::<4>(q, q16, keys, key, value, scale, acc16, out) },
        (128, 128) => unsafe { flash_attn_fixed::<8>(q, q16, keys, key, value, scale, acc16, out) },
        _ => unsafe { flash_attn_any(q, q16, keys, key, value, scale, acc16, out) },
    }
}

/// Rounds `q` to f16 (into `q16`) and widens it to f64 (into `qd`).
#[target_feature(enable = "neon")]
#[inline]
fn round_query(q: &[f32], q16: &mut [F16Le], qd: &mut [f64]) {
    for ((q, h), d) in q.chunks_exact(8).zip(q16.chunks_exact_mut(8)).zip(qd.chunks_exact_mut(8)) {
        let r = f16_narrow(ld_f32x4(q), ld_f32x4(&q[4..]));
        st_f16x8(h, r);
        let (lo, hi) = (f16_lo(r), f16_hi(r));
        let w = [
            vcvt_f64_f32(vget_low_f32(lo)),
            vcvt_high_f64_f32(lo),
            vcvt_f64_f32(vget_low_f32(hi)),
            vcvt_high_f64_f32(hi),
        ];
        for (d, w) in d.chunks_exact_mut(2).zip(w) {
            let d: &mut [f64; 2] = d.try_into().unwrap();
            // SAFETY: writes the 2 doubles of `d`.
            unsafe { vst1q_f64(d.as_mut_ptr(), w) };
        }
    }
}

/// The reference's per-key softmax step for score `s`: returns `(ms, vs)` (the rescale of what
/// was accumulated, 1 if none, and the weight of this key's value) and updates `max`, `sum`.
#[inline(always)]
fn softmax_step(s: f32, max: &mut f32, sum: &mut f32) -> (f32, f32) {
    let (mut ms, mut vs) = (1.0f32, 1.0f32);
    if s > *max {
        ms = libm::expf(*max - s);
        *max = s;
    } else {
        vs = libm::expf(s - *max);
    }
    *sum = *sum * ms + vs;
    (ms, vs)
}

/// The reference's softmax steps over a chunk of scores (whole steps of 4, at most
/// [`KEY_CHUNK`]), the running maximum as a prefix max four keys at a time: per key, `e` (the
/// `expf` of `max - s` for a key that raises the maximum, else of `s - max`) and `raise` (all ones
/// for a raising key). The sum is left to the value updates.
#[target_feature(enable = "neon")]
fn softmax_exps(s: &[f32], max: &mut f32, e: &mut [f32; KEY_CHUNK], raise: &mut [u32; KEY_CHUNK]) {
    let ninf = vdupq_n_f32(f32::NEG_INFINITY);
    let mut m = vdupq_n_f32(*max);
    for ((s, e), r) in s.chunks_exact(4).zip(e.chunks_exact_mut(4)).zip(raise.chunks_exact_mut(4)) {
        let s = ld_f32x4(s);
        // Prefix max ignoring NaNs ("s > max" is false for them), then each key's previous max.
        let p = vmaxnmq_f32(s, vextq_f32::<3>(ninf, s));
        let p = vmaxnmq_f32(vmaxnmq_f32(p, vextq_f32::<2>(ninf, p)), m);
        let prev = vextq_f32::<3>(m, p);
        m = vdupq_laneq_f32::<3>(p);
        let up = vcgtq_f32(s, prev);
        let (x, ok) = expf4(vbslq_f32(up, vsubq_f32(prev, s), vsubq_f32(s, prev)));
        st_f32x4(e, x);
        let r: &mut [u32; 4] = r.try_into().unwrap();
        // SAFETY: writes the 4 lanes of `r`.
        unsafe { vst1q_u32(r.as_mut_ptr(), up) };
        if vminvq_u32(ok) == 0 {
            let mut a = [0f32; 4];
            st_f32x4(&mut a, vbslq_f32(up, vsubq_f32(prev, s), vsubq_f32(s, prev)));
            for (e, a) in e.iter_mut().zip(a) {
                *e = libm::expf(a);
            }
        }
    }
    *max = vgetq_lane_f32::<0>(m);
}

/// `libm::expf` for 4 lanes (the same FreeBSD steps in the same order, the final `scalbnf` as an
/// exponent add), exact on the lanes of the returned mask: `-86 <= x <= 0`, where `2^k` keeps the
/// result normal, and `x <= -103.972084`, where it is 0.
#[target_feature(enable = "neon")]
#[inline]
fn expf4(x: float32x4_t) -> (float32x4_t, uint32x4_t) {
    const INV_LN2: f32 = f32::from_bits(0x3fb8_aa3b);
    const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
    const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
    const P1: f32 = 1.666_662_5e-1;
    const P2: f32 = -2.766_733_3e-3;
    let one = vdupq_n_f32(1.0);
    let ax = vreinterpretq_u32_f32(vabsq_f32(x));
    // |x| > 1.5 ln2: k = trunc(x / ln2 - 0.5); 0.5 ln2 < |x| <= 1.5 ln2: k = -1; below: k = 0.
    let ka = vcvtq_s32_f32(vaddq_f32(vmulq_n_f32(x, INV_LN2), vdupq_n_f32(-0.5)));
    let k = vbslq_s32(vcgtq_u32(ax, vdupq_n_u32(0x3f85_1592)), ka, vdupq_n_s32(-1));
    let k = vandq_s32(k, vreinterpretq_s32_u32(vcgtq_u32(ax, vdupq_n_u32(0x3eb1_7218))));
    let kf = vcvtq_f32_s32(k);
    let hi = vsubq_f32(x, vmulq_n_f32(kf, LN2_HI));
    let lo = vmulq_n_f32(kf, LN2_LO);
    let r = vsubq_f32(hi, lo);
    let rr = vmulq_f32(r, r);
    let c = vsubq_f32(r, vmulq_f32(rr, vaddq_f32(vdupq_n_f32(P1), vmulq_n_f32(rr, P2))));
    let y = vdivq_f32(vmulq_f32(r, c), vsubq_f32(vdupq_n_f32(2.0), c));
    let y = vaddq_f32(one, vaddq_f32(vsubq_f32(y, lo), hi));
    let y = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(y), vshlq_n_s32::<23>(k)));
    // |x| <= 2^-14: 1 + x; x <= -103.972084 (-inf included): 0.
    let y = vbslq_f32(vcleq_u32(ax, vdupq_n_u32(0x3900_0000)), vaddq_f32(one, x), y);
    let zero = vcgeq_u32(ax, vdupq_n_u32(0x42cf_f1b5));
    let y = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), zero));
    (y, vandq_u32(vclezq_f32(x), vorrq_u32(vcaleq_f32(x, vdupq_n_f32(86.0)), zero)))
}

/// `f16(acc * ms)` for 8 f16 accumulators (raw bits).
#[target_feature(enable = "neon")]
#[inline]
fn rescale8(a: uint16x8_t, ms: f32) -> uint16x8_t {
    f16_narrow(vmulq_n_f32(f16_lo(a), ms), vmulq_n_f32(f16_hi(a), ms))
}

/// `f16(fma(v, vs, acc))` for 8 f16 accumulators and values (raw bits).
#[target_feature(enable = "neon")]
#[inline]
fn mad8(a: uint16x8_t, v: uint16x8_t, vs: f32) -> uint16x8_t {
    f16_narrow(vfmaq_n_f32(f16_lo(a), f16_lo(v), vs), vfmaq_n_f32(f16_hi(a), f16_hi(v), vs))
}

/// Keys per chunk of [`flash_attn_fixed`]'s three passes.
const KEY_CHUNK: usize = 32;

/// Flash attention for `dk == dv == 16 N` (64 or 128), in chunks of keys and three passes per
/// chunk: the scores (`asm!`), the reference's scalar softmax steps (`expf`), the value updates
/// (`asm!`, the f16 accumulator in registers).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
fn flash_attn_fixed<'k, const N: usize>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    let d = 16 * N;
    let mut qd = [0f64; 128];
    round_query(q, q16, &mut qd[..d]);
    let mut acc = [vdupq_n_u16(0); 16];
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    let mut j = keys.start;
    while j < keys.end {
        let m = (keys.end - j).min(KEY_CHUNK);
        let (mut rows, mut vrows) =
            ([core::ptr::null::<F16Le>(); KEY_CHUNK], [core::ptr::null::<F16Le>(); KEY_CHUNK]);
        for (i, (r, v)) in rows[..m].iter_mut().zip(&mut vrows[..m]).enumerate() {
            (*r, *v) = (key(j + i)[..d].as_ptr(), value(j + i)[..d].as_ptr());
        }
        let mut s = [0f32; KEY_CHUNK];
        // SAFETY: `rows[..m]` point at `d` f16 each, `qd` holds `d` doubles, `s` `m` floats.
        unsafe { key_scores(N, &qd, &rows[..m], scale, &mut s[..m]) };
        // Whole steps of 4 for the softmax: the last score repeats (it cannot raise the maximum
        // again; its extra exps are not used).
        let m4 = m.next_multiple_of(4);
        let last = s[m - 1];
        s[m..m4].fill(last);
        let (mut e, mut raise) = ([0f32; KEY_CHUNK], [0u32; KEY_CHUNK]);
        softmax_exps(&s[..m4], &mut max, &mut e, &mut raise);
        // SAFETY: `vrows[..m]` point at `d` f16 each, `e` and `raise` hold `m` entries.
        unsafe { value_updates(N, &mut acc, &vrows[..m], &e[..m], &raise[..m], &mut sum) };
        j += m;
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for ((a, h), o) in acc.iter().zip(acc16.chunks_exact_mut(8)).zip(out.chunks_exact_mut(8)) {
        st_f16x8(h, *a);
        st_f32x4(o, vmulq_n_f32(f16_lo(*a), inv));
        st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(*a), inv));
    }
}

/// Products of 16 values of a key row (`{p}`, f16) with the query's (`{qp}`, f64), added to
/// v8-v11 (`$op` is `fmul` for the first 16, else `fmla`): exact products, summed in f64.
#[rustfmt::skip]
macro_rules! kdot16 { ($op:literal) => { concat!(
    "ld1 {{v0.8h, v1.8h}}, [{p}], #32\n",
    "fcvtl v2.4s, v0.4h\n",              "fcvtl2 v3.4s, v0.8h\n",
    "fcvtl v4.4s, v1.4h\n",              "fcvtl2 v5.4s, v1.8h\n",
    "fcvtl v16.2d, v2.2s\n",             "fcvtl2 v17.2d, v2.4s\n",
    "fcvtl v18.2d, v3.2s\n",             "fcvtl2 v19.2d, v3.4s\n",
    "fcvtl v20.2d, v4.2s\n",             "fcvtl2 v21.2d, v4.4s\n",
    "fcvtl v22.2d, v5.2s\n",             "fcvtl2 v23.2d, v5.4s\n",
    "ld1 {{v24.2d, v25.2d, v26.2d, v27.2d}}, [{qp}], #64\n",
    "ld1 {{v28.2d, v29.2d, v30.2d, v31.2d}}, [{qp}], #64\n",
    $op, " v8.2d, v16.2d, v24.2d\n",     $op, " v9.2d, v17.2d, v25.2d\n",
    $op, " v10.2d, v18.2d, v26.2d\n",    $op, " v11.2d, v19.2d, v27.2d\n",
    "fmla v8.2d, v20.2d, v28.2d\n",      "fmla v9.2d, v21.2d, v29.2d\n",
    "fmla v10.2d, v22.2d, v30.2d\n",     "fmla v11.2d, v23.2d, v31.2d\n",
) } }

/// The f64 sum in v8-v11 rounded to f32, times the scale (s14), stored.
#[rustfmt::skip]
macro_rules! kscore { () => { concat!(
    "fadd v8.2d, v8.2d, v9.2d\n",
    "fadd v10.2d, v10.2d, v11.2d\n",
    "fadd v8.2d, v8.2d, v10.2d\n",
    "faddp d8, v8.2d\n",
    "fcvt s8, d8\n",
    "fmul s8, s8, s14\n",
    "str s8, [{out}], #4\n",
) } }

/// `scores[i] = (key row i . query) * scale` for the query widened to f64 (`qd`, `16 n` values,
/// n = 4 or 8): the reference's score (exact products summed in f64, rounded to f32) whenever the
/// f64 sum is exact, whatever its order.
///
/// # Safety
/// Each row points at `16 n` f16 values; `rows.len() == scores.len() > 0`.
#[target_feature(enable = "neon")]
unsafe fn key_scores(n: usize, qd: &[f64; 128], rows: &[*const F16Le], scale: f32, scores: &mut [f32]) {
    debug_assert!(scores.len() == rows.len() && !rows.is_empty());
    if n == 4 {
        // SAFETY: the caller's contract; every register written is declared clobbered.
        unsafe {
            asm!(
                "2:",
                "ldr {p}, [{rows}], #8",
                "mov {qp}, {qd}",
                kdot16!("fmul"), kdot16!("fmla"), kdot16!("fmla"), kdot16!("fmla"),
                kscore!(),
                "subs {n}, {n}, #1",
                "b.ne 2b",
                rows = inout(reg) rows.as_ptr() => _,
                out = inout(reg) scores.as_mut_ptr() => _,
                n = inout(reg) rows.len() => _,
                qd = in(reg) qd.as_ptr(),
                qp = out(reg) _,
                p = out(reg) _,
                in("v14") scale,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    } else {
        // SAFETY: the caller's contract; every register written is declared clobbered.
        unsafe {
            asm!(
                "2:",
                "ldr {p}, [{rows}], #8",
                "mov {qp}, {qd}",
                kdot16!("fmul"), kdot16!("fmla"), kdot16!("fmla"), kdot16!("fmla"),
                kdot16!("fmla"), kdot16!("fmla"), kdot16!("fmla"), kdot16!("fmla"),
                kscore!(),
                "subs {n}, {n}, #1",
                "b.ne 2b",
                rows = inout(reg) rows.as_ptr() => _,
                out = inout(reg) scores.as_mut_ptr() => _,
                n = inout(reg) rows.len() => _,
                qd = in(reg) qd.as_ptr(),
                qp = out(reg) _,
                p = out(reg) _,
                in("v14") scale,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _,
                out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                options(nostack),
            );
        }
    }
}

/// `acc = f16(fma(v, vs, acc))` for the accumulator `v$a` and values `v$v` (8 each).
#[rustfmt::skip]
macro_rules! vmad8 { ($a:literal, $v:literal) => { concat!(
    "fcvtl v24.4s, v", $a, ".4h\n",      "fcvtl2 v25.4s, v", $a, ".8h\n",
    "fcvtl v26.4s, v", $v, ".4h\n",      "fcvtl2 v27.4s, v", $v, ".8h\n",
    "fmla v24.4s, v26.4s, v29.s[0]\n",   "fmla v25.4s, v27.4s, v29.s[0]\n",
    "fcvtn v", $a, ".4h, v24.4s\n",      "fcvtn2 v", $a, ".8h, v25.4s\n",
) } }

/// `acc = f16(acc * ms)` for the accumulator `v$a` (8 values; ms in v29).
#[rustfmt::skip]
macro_rules! vscale8 { ($a:literal) => { concat!(
    "fcvtl v24.4s, v", $a, ".4h\n",      "fcvtl2 v25.4s, v", $a, ".8h\n",
    "fmul v24.4s, v24.4s, v29.s[0]\n",   "fmul v25.4s, v25.4s, v29.s[0]\n",
    "fcvtn v", $a, ".4h, v24.4s\n",      "fcvtn2 v", $a, ".8h, v25.4s\n",
) } }

/// Per key of the chunk, the reference's updates: for a key that raises the maximum (`raise`),
/// `acc = f16(acc * e)`, `vs = 1` and `sum = sum * e + 1`; else `vs = e` and `sum = sum + e`
/// (`sum * 1 + e`); then `acc = f16(fma(v, vs, acc))`, for `16 n` accumulators (n = 4 or 8)
/// kept in registers.
///
/// # Safety
/// Each row points at `16 n` f16 values; `e.len() == raise.len() == rows.len() > 0`.
#[target_feature(enable = "neon")]
unsafe fn value_updates(
    n: usize,
    acc: &mut [uint16x8_t; 16],
    rows: &[*const F16Le],
    e: &[f32],
    raise: &[u32],
    sum: &mut f32,
) {
    debug_assert!(e.len() == rows.len() && raise.len() == rows.len() && !rows.is_empty());
    let [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15] = acc;
    if n == 4 {
        // SAFETY: the caller's contract; every register written is an operand or clobbered.
        unsafe {
            asm!(
                "fmov s30, #1.0",
                "2:",
                "ldr {p}, [{rows}], #8",
                "ldr s29, [{e}], #4",
                "ldr {f:w}, [{raise}], #4",
                "ld1 {{v16.8h, v17.8h, v18.8h, v19.8h}}, [{p}], #64",
                "ld1 {{v20.8h, v21.8h, v22.8h, v23.8h}}, [{p}]",
                "cbnz {f:w}, 4f",
                "fadd {sum:s}, {sum:s}, s29",
                "3:",
                vmad8!("0", "16"), vmad8!("1", "17"), vmad8!("2", "18"), vmad8!("3", "19"),
                vmad8!("4", "20"), vmad8!("5", "21"), vmad8!("6", "22"), vmad8!("7", "23"),
                "subs {n}, {n}, #1",
                "b.ne 2b",
                "b 5f",
                "4:",
                "fmul {sum:s}, {sum:s}, s29",
                "fadd {sum:s}, {sum:s}, s30",
                vscale8!("0"), vscale8!("1"), vscale8!("2"), vscale8!("3"),
                vscale8!("4"), vscale8!("5"), vscale8!("6"), vscale8!("7"),
                "fmov s29, #1.0",
                "b 3b",
                "5:",
                rows = inout(reg) rows.as_ptr() => _,
                e = inout(reg) e.as_ptr() => _,
                raise = inout(reg) raise.as_ptr() => _,
                n = inout(reg) rows.len() => _,
                p = out(reg) _,
                f = out(reg) _,
                sum = inout(vreg) *sum,
                inout("v0") *a0, inout("v1") *a1, inout("v2") *a2, inout("v3") *a3,
                inout("v4") *a4, inout("v5") *a5, inout("v6") *a6, inout("v7") *a7,
                out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v29") _, out("v30") _,
                options(nostack),
            );
        }
    } else {
        // SAFETY: the caller's contract; every register written is an operand or clobbered.
        unsafe {
            asm!(
                "fmov s30, #1.0",
                "2:",
                "ldr {p}, [{rows}], #8",
                "ldr s29, [{e}], #4",
                "ldr {f:w}, [{raise}], #4",
                "ld1 {{v16.8h, v17.8h, v18.8h, v19.8h}}, [{p}], #64",
                "ld1 {{v20.8h, v21.8h, v22.8h, v23.8h}}, [{p}], #64",
                "cbnz {f:w}, 4f",
                "fadd {sum:s}, {sum:s}, s29",
                "3:",
                vmad8!("0", "16"), vmad8!("1", "17"), vmad8!("2", "18"), vmad8!("3", "19"),
                vmad8!("4", "20"), vmad8!("5", "21"), vmad8!("6", "22"), vmad8!("7", "23"),
                "ld1 {{v16.8h, v17.8h, v18.8h, v19.8h}}, [{p}], #64",
                "ld1 {{v20.8h, v21.8h, v22.8h, v23.8h}}, [{p}]",
                vmad8!("8", "16"), vmad8!("9", "17"), vmad8!("10", "18"), vmad8!("11", "19"),
                vmad8!("12", "20"), vmad8!("13", "21"), vmad8!("14", "22"), vmad8!("15", "23"),
                "subs {n}, {n}, #1",
                "b.ne 2b",
                "b 5f",
                "4:",
                "fmul {sum:s}, {sum:s}, s29",
                "fadd {sum:s}, {sum:s}, s30",
                vscale8!("0"), vscale8!("1"), vscale8!("2"), vscale8!("3"),
                vscale8!("4"), vscale8!("5"), vscale8!("6"), vscale8!("7"),
                vscale8!("8"), vscale8!("9"), vscale8!("10"), vscale8!("11"),
                vscale8!("12"), vscale8!("13"), vscale8!("14"), vscale8!("15"),
                "fmov s29, #1.0",
                "b 3b",
                "5:",
                rows = inout(reg) rows.as_ptr() => _,
                e = inout(reg) e.as_ptr() => _,
                raise = inout(reg) raise.as_ptr() => _,
                n = inout(reg) rows.len() => _,
                p = out(reg) _,
                f = out(reg) _,
                sum = inout(vreg) *sum,
                inout("v0") *a0, inout("v1") *a1, inout("v2") *a2, inout("v3") *a3,
                inout("v4") *a4, inout("v5") *a5, inout("v6") *a6, inout("v7") *a7,
                inout("v8") *a8, inout("v9") *a9, inout("v10") *a10, inout("v11") *a11,
                inout("v12") *a12, inout("v13") *a13, inout("v14") *a14, inout("v15") *a15,
                out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                out("v29") _, out("v30") _,
                options(nostack),
            );
        }
    }
}

/// Flash attention for any `dk`, `dv` that are multiples of 8 (at most `MAX_HEAD`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
fn flash_attn_any<'k>(
    q: &[f32],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    out: &mut [f32],
) {
    let (dk, dv) = (q.len(), out.len());
    let mut qbuf = [0f64; MAX_HEAD];
    round_query(q, q16, &mut qbuf[..dk]);
    let qd = &qbuf[..dk];
    acc16.fill(F16Le::from_bits(0));
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    for j in keys {
        // Exact products summed in f64, as `key_scores`.
        let mut d = [vdupq_n_f64(0.0); 4];
        for (k, q) in key(j)[..dk].chunks_exact(8).zip(qd.chunks_exact(8)) {
            let h = ld_f16x8(k);
            let (lo, hi) = (f16_lo(h), f16_hi(h));
            let k = [
                vcvt_f64_f32(vget_low_f32(lo)),
                vcvt_high_f64_f32(lo),
                vcvt_f64_f32(vget_low_f32(hi)),
                vcvt_high_f64_f32(hi),
            ];
            for (i, (d, k)) in d.iter_mut().zip(k).enumerate() {
                let q: &[f64; 2] = q[2 * i..2 * i + 2].try_into().unwrap();
                // SAFETY: reads the 2 doubles of `q`.
                *d = vfmaq_f64(*d, k, unsafe { vld1q_f64(q.as_ptr()) });
            }
        }
        let s = vaddvq_f64(vaddq_f64(vaddq_f64(d[0], d[1]), vaddq_f64(d[2], d[3]))) as f32 * scale;
        let (ms, vs) = softmax_step(s, &mut max, &mut sum);
        for (a, v) in acc16.chunks_exact_mut(8).zip(value(j)[..dv].chunks_exact(8)) {
            let mut h = ld_f16x8(a);
            if ms != 1.0 {
                h = rescale8(h, ms);
            }
            st_f16x8(a, mad8(h, ld_f16x8(v), vs));
        }
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, a) in out.chunks_exact_mut(8).zip(acc16.chunks_exact(8)) {
        let h = ld_f16x8(a);
        st_f32x4(o, vmulq_n_f32(f16_lo(h), inv));
        st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(h), inv));
    }
}

/// Several query rows over the same keys (the query heads of one KV head):
/// `reference::flash_attn_rows_ref`'s results, bit-identical to [`flash_attn_row`] per row (the
/// same sums in the same order), with each key and value row loaded and widened once for all rows.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_rows<'k>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let n = qs.len().min(outs.len());
    if n == 0 {
        return;
    }
    let (dk, dv) = (qs[0].len(), outs[0].len());
    if n == 1 {
        return flash_attn_row(qs[0], &mut q16[..dk], keys, key, value, scale, &mut acc16[..dv], outs[0]);
    }
    let fits = n <= FLASH_ROWS
        && dk <= MAX_HEAD
        && dv <= MAX_HEAD
        && dk % 8 == 0
        && dv % 8 == 0
        && q16.len() >= n * dk
        && acc16.len() >= n * dv
        && qs[..n].iter().all(|q| q.len() == dk)
        && outs[..n].iter().all(|o| o.len() == dv);
    if !fits {
        return flash_attn_rows_ref(qs, q16, keys, key, value, scale, acc16, outs);
    }
    let (qs, outs) = (&qs[..n], &mut outs[..n]);
    // SAFETY (each arm): NEON is part of the aarch64 baseline.
    match n {
        2 => unsafe { flash_attn_multi::<2>(qs, q16, keys, key, value, scale, acc16, outs) },
        3 => unsafe { flash_attn_multi::<3>(qs, q16, keys, key, value, scale, acc16, outs) },
        _ => unsafe { flash_attn_multi::<4>(qs, q16, keys, key, value, scale, acc16, outs) },
    }
}

/// [`flash_attn_rows`] for `R` rows (checked shapes: `dk`, `dv` multiples of 8 up to
/// `MAX_HEAD`), in chunks of keys: the scores of every row (each key widened once), each row's
/// softmax steps, then the value updates in slices of 16 dimensions (each value widened once; the
/// accumulators of 4 rows and the widened values fit in registers).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
fn flash_attn_multi<'k, const R: usize>(
    qs: &[&[f32]],
    q16: &mut [F16Le],
    keys: Range<usize>,
    key: impl Fn(usize) -> &'k [F16Le],
    value: impl Fn(usize) -> &'k [F16Le],
    scale: f32,
    acc16: &mut [F16Le],
    outs: &mut [&mut [f32]],
) {
    let (dk, dv) = (qs[0].len(), outs[0].len());
    // Head sizes that are multiples of 16 up to `PACKED_HEAD` take the `mscores` kernels (the
    // queries packed into `qp`); the rest `multi_scores` (the queries in `qd`, only then zeroed).
    let mut qp = [0f64; 4 * PACKED_HEAD];
    let mut qd_store = None;
    let qd: Option<&[[f64; MAX_HEAD]; R]> = if dk % 16 == 0 && dk <= PACKED_HEAD {
        let mut rows = [[0f64; PACKED_HEAD]; R];
        for (r, (q, d)) in qs.iter().zip(&mut rows).enumerate() {
            round_query(q, &mut q16[r * dk..(r + 1) * dk], &mut d[..dk]);
        }
        pack_queries(&rows, dk, &mut qp);
        None
    } else {
        let qd = qd_store.insert([[0f64; MAX_HEAD]; R]);
        for (r, q) in qs.iter().enumerate() {
            round_query(q, &mut q16[r * dk..(r + 1) * dk], &mut qd[r][..dk]);
        }
        Some(qd)
    };
    let acc16 = &mut acc16[..R * dv];
    acc16.fill(F16Le::from_bits(0));
    let mut max = [f32::NEG_INFINITY; R];
    let mut sum = vdupq_n_f32(0.0);
    let mut j = keys.start;
    while j < keys.end {
        let m = (keys.end - j).min(KEY_CHUNK);
        let (mut krows, mut vrows) =
            ([core::ptr::null::<F16Le>(); KEY_CHUNK], [core::ptr::null::<F16Le>(); KEY_CHUNK]);
        for (i, (k, v)) in krows[..m].iter_mut().zip(&mut vrows[..m]).enumerate() {
            (*k, *v) = (key(j + i)[..dk].as_ptr(), value(j + i)[..dv].as_ptr());
        }
        let mut s = [[0f32; KEY_CHUNK]; R];
        match qd {
            // SAFETY: `krows[..m]` point at `dk` f16 each; `qd` rows hold `dk` doubles.
            Some(qd) => unsafe { multi_scores::<R>(qd, dk, &krows[..m], scale, &mut s) },
            None => {
                let mut srows = s.each_mut().map(|s| &mut s[..m]);
                let (qp, rows) = (&qp[..R * dk], &krows[..m]);
                // SAFETY (each arm): `rows` point at `dk` f16 each (a multiple of 16), `qp`
                // holds the `R dk` packed doubles, `srows` `R` rows of `m > 0` floats.
                unsafe {
                    match R {
                        2 => mscores2(qp, dk, rows, scale, &mut srows),
                        3 => mscores3(qp, dk, rows, scale, &mut srows),
                        _ => mscores4(qp, dk, rows, scale, &mut srows),
                    }
                }
            }
        }
        // Per key: the rescale of each row's accumulator (1 where the key does not raise that
        // row's maximum: exact) and each row's value weight; whether any row rescales.
        let (mut ms, mut vs) = ([[1f32; 4]; KEY_CHUNK], [[1f32; 4]; KEY_CHUNK]);
        let mut any = [false; KEY_CHUNK];
        let m4 = m.next_multiple_of(4);
        for (r, s) in s.iter_mut().enumerate() {
            // Whole steps of 4, as in `flash_attn_fixed`.
            let last = s[m - 1];
            s[m..m4].fill(last);
            let (mut e, mut raise) = ([0f32; KEY_CHUNK], [0u32; KEY_CHUNK]);
            softmax_exps(&s[..m4], &mut max[r], &mut e, &mut raise);
            for (i, (&e, &up)) in e[..m].iter().zip(&raise[..m]).enumerate() {
                if up != 0 {
                    (ms[i][r], any[i]) = (e, true);
                } else {
                    vs[i][r] = e;
                }
            }
        }
        // The reference's `sum = sum * ms + vs`, all rows at once (`* 1` is exact).
        for ((v, m), &up) in vs[..m].iter().zip(&ms[..m]).zip(&any[..m]) {
            let v = ld_f32x4(v);
            sum = if up { vaddq_f32(vmulq_f32(sum, ld_f32x4(m)), v) } else { vaddq_f32(sum, v) };
        }
        let mut d = 0;
        while d < dv {
            // SAFETY (each arm): `vrows[..m]` point at `dv` f16 each, `d + 8 w <= dv`.
            unsafe {
                match (dv - d) / 8 {
                    1 => multi_values::<R, 1>(acc16, dv, d, &vrows[..m], &ms, &vs, &any),
                    _ => multi_values::<R, 2>(acc16, dv, d, &vrows[..m], &ms, &vs, &any),
                }
            }
            d += 16;
        }
        j += m;
    }
    let mut sums = [0f32; 4];
    st_f32x4(&mut sums, sum);
    for (r, out) in outs.iter_mut().enumerate() {
        let inv = if sums[r] == 0.0 { 0.0 } else { 1.0 / sums[r] };
        for (o, a) in out.chunks_exact_mut(8).zip(acc16[r * dv..(r + 1) * dv].chunks_exact(8)) {
            let h = ld_f16x8(a);
            st_f32x4(o, vmulq_n_f32(f16_lo(h), inv));
            st_f32x4(&mut o[4..], vmulq_n_f32(f16_hi(h), inv));
        }
    }
}

/// Longest head of the `mscores` kernels (their packed queries' buffer).
const PACKED_HEAD: usize = 128;

/// 16 dimensions of a key row (`{p}`, f16) widened to f64 into v0, v1, v6, v7 (dimensions 0..8)
/// and v2, v3, v5, v4 (8..16), in eight registers.
#[rustfmt::skip]
macro_rules! mkey16 { () => { concat!(
    "ld1 {{v0.8h, v1.8h}}, [{p}], #32\n",
    "fcvtl v2.4s, v0.4h\n",              "fcvtl2 v3.4s, v0.8h\n",
    "fcvtl v4.4s, v1.4h\n",              "fcvtl2 v5.4s, v1.8h\n",
    "fcvtl v0.2d, v2.2s\n",              "fcvtl2 v1.2d, v2.4s\n",
    "fcvtl v6.2d, v3.2s\n",              "fcvtl2 v7.2d, v3.4s\n",
    "fcvtl v2.2d, v4.2s\n",              "fcvtl2 v3.2d, v4.4s\n",
    "fcvtl2 v4.2d, v5.4s\n",             "fcvtl v5.2d, v5.2s\n",
) } }

/// One query row's 16 doubles (`{qp}`) times the widened key of [`mkey16`], added to the row's
/// accumulators `v$a0..v$a3` (`$op` is `fmul` for a row's first 16, else `fmla`): `kdot16`'s
/// sums in `kdot16`'s order.
#[rustfmt::skip]
macro_rules! mrow16 { ($op:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "ld1 {{v24.2d, v25.2d, v26.2d, v27.2d}}, [{qp}], #64\n",
    "ld1 {{v28.2d, v29.2d, v30.2d, v31.2d}}, [{qp}], #64\n",
    $op, " v", $a0, ".2d, v0.2d, v24.2d\n",  $op, " v", $a1, ".2d, v1.2d, v25.2d\n",
    $op, " v", $a2, ".2d, v6.2d, v26.2d\n",  $op, " v", $a3, ".2d, v7.2d, v27.2d\n",
    "fmla v", $a0, ".2d, v2.2d, v28.2d\n",   "fmla v", $a1, ".2d, v3.2d, v29.2d\n",
    "fmla v", $a2, ".2d, v5.2d, v30.2d\n",   "fmla v", $a3, ".2d, v4.2d, v31.2d\n",
) } }

/// A row's four f64 accumulators `v$a0..v$a3` summed as `kscore` does, into `v$a0`.
#[rustfmt::skip]
macro_rules! mfold { ($a0:literal, $a1:literal, $a2:literal, $a3:literal) => { concat!(
    "fadd v", $a0, ".2d, v", $a0, ".2d, v", $a1, ".2d\n",
    "fadd v", $a2, ".2d, v", $a2, ".2d, v", $a3, ".2d\n",
    "fadd v", $a0, ".2d, v", $a0, ".2d, v", $a2, ".2d\n",
) } }

/// Defines an `asm!` twin of `multi_scores` for `R` rows and `dk` a multiple of 16: per key, each
/// 16 dimensions of the key widened once ([`mkey16`]) for every row ([`mrow16`], the query rows
/// packed by [`pack_queries`]), the sums folded, rounded to f32 (`faddp`/`fcvtn` of two rows at
/// once: the same operations as `kscore`'s per row), times the scale, one lane stored per row.
#[rustfmt::skip]
macro_rules! mscores_kernel {
    ($name:ident, $r:literal, [$( ($a0:literal, $a1:literal, $a2:literal, $a3:literal) ),+],
     [$( $fin:literal ),+], [$( ($o:ident, $lane:literal) ),+]) => {
        /// # Safety
        /// Each row points at `dk` f16 values, `dk` a positive multiple of 16; `qp` holds the
        /// `R dk` doubles of [`pack_queries`]; `rows.len() > 0`; `s` is `R` rows of at least
        /// `rows.len()` floats.
        #[target_feature(enable = "neon")]
        unsafe fn $name(qp: &[f64], dk: usize, rows: &[*const F16Le], scale: f32, s: &mut [&mut [f32]]) {
            debug_assert!(!rows.is_empty() && dk % 16 == 0 && dk > 0 && qp.len() >= $r * dk);
            debug_assert!(s.iter().all(|s| s.len() >= rows.len()));
            let [$( $o ),+] = s else { unreachable!("{} score rows", $r) };
            $( let $o = $o.as_mut_ptr(); )+
            // SAFETY: the function's contract; every register written is declared clobbered.
            unsafe {
                asm!(
                    "2:",
                    "ldr {p}, [{rows}], #8",
                    "mov {qp}, {qd}",
                    mkey16!(),
                    $( mrow16!("fmul", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {pieces}, #1",
                    "b.eq 4f",
                    "3:",
                    mkey16!(),
                    $( mrow16!("fmla", $a0, $a1, $a2, $a3), )+
                    "subs {c}, {c}, #1",
                    "b.ne 3b",
                    "4:",
                    $( mfold!($a0, $a1, $a2, $a3), )+
                    $( $fin, )+
                    "dup v24.4s, {sc:w}",
                    "fmul v8.4s, v8.4s, v24.4s",
                    $( concat!("st1 {{v8.s}}[", $lane, "], [", op!($o), "], #4"), )+
                    "subs {n}, {n}, #1",
                    "b.ne 2b",
                    rows = inout(reg) rows.as_ptr() => _,
                    n = inout(reg) rows.len() => _,
                    qd = in(reg) qp.as_ptr(),
                    pieces = in(reg) dk / 16,
                    sc = in(reg) scale.to_bits(),
                    qp = out(reg) _,
                    p = out(reg) _,
                    c = out(reg) _,
                    $( $o = inout(reg) $o => _, )+
                    out("v0") _, out("v1") _, out("v2") _, out("v3") _,
                    out("v4") _, out("v5") _, out("v6") _, out("v7") _,
                    out("v8") _, out("v9") _, out("v10") _, out("v11") _,
                    out("v12") _, out("v13") _, out("v14") _, out("v15") _,
                    out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                    out("v20") _, out("v21") _, out("v22") _, out("v23") _,
                    out("v24") _, out("v25") _, out("v26") _, out("v27") _,
                    out("v28") _, out("v29") _, out("v30") _, out("v31") _,
                    options(nostack),
                );
            }
        }
    };
}

#[rustfmt::skip]
mscores_kernel!(mscores2, 2, [("8", "9", "10", "11"), ("12", "13", "14", "15")],
    ["faddp v8.2d, v8.2d, v12.2d", "fcvtn v8.2s, v8.2d"], [(o0, "0"), (o1, "1")]);
#[rustfmt::skip]
mscores_kernel!(mscores3, 3, [("8", "9", "10", "11"), ("12", "13", "14", "15"), ("16", "17", "18", "19")],
    ["faddp v8.2d, v8.2d, v12.2d", "faddp v16.2d, v16.2d, v16.2d", "fcvtn v8.2s, v8.2d", "fcvtn2 v8.4s, v16.2d"],
    [(o0, "0"), (o1, "1"), (o2, "2")]);
#[rustfmt::skip]
mscores_kernel!(mscores4, 4,
    [("8", "9", "10", "11"), ("12", "13", "14", "15"), ("16", "17", "18", "19"), ("20", "21", "22", "23")],
    ["faddp v8.2d, v8.2d, v12.2d", "faddp v16.2d, v16.2d, v20.2d", "fcvtn v8.2s, v8.2d", "fcvtn2 v8.4s, v16.2d"],
    [(o0, "0"), (o1, "1"), (o2, "2"), (o3, "3")]);

/// The `R` query rows (widened to f64, `dk` each, a multiple of 16) in the order the `mscores`
/// kernels read them: per 16 dimensions, those of row 0, 1, ...
fn pack_queries<const R: usize>(qd: &[[f64; PACKED_HEAD]; R], dk: usize, qp: &mut [f64]) {
    for (c, chunk) in qp[..R * dk].chunks_exact_mut(16 * R).enumerate() {
        for (q, dst) in qd.iter().zip(chunk.chunks_exact_mut(16)) {
            dst.copy_from_slice(&q[16 * c..16 * c + 16]);
        }
    }
}

/// `s[r][i] = (key row i . query r) * scale` for `R` queries widened to f64, each key row
/// widened once: exact products summed in f64 in `flash_attn_any`'s (and `key_scores`') order.
///
/// # Safety
/// Each row points at `dk` f16 values, `dk` a multiple of 8 and at most `MAX_HEAD`;
/// `rows.len() <= KEY_CHUNK`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn multi_scores<const R: usize>(
    qd: &[[f64; MAX_HEAD]; R],
    dk: usize,
    rows: &[*const F16Le],
    scale: f32,
    s: &mut [[f32; KEY_CHUNK]; R],
) {
    for (i, &p) in rows.iter().enumerate() {
        let mut d = [[vdupq_n_f64(0.0); 4]; R];
        for c in 0..dk / 8 {
            // SAFETY: `8 c + 8 <= dk` values of the row (the caller's contract).
            let h = unsafe { vld1q_u16(p.add(8 * c).cast()) };
            let (lo, hi) = (f16_lo(h), f16_hi(h));
            let k = [
                vcvt_f64_f32(vget_low_f32(lo)),
                vcvt_high_f64_f32(lo),
                vcvt_f64_f32(vget_low_f32(hi)),
                vcvt_high_f64_f32(hi),
            ];
            for (d, q) in d.iter_mut().zip(qd) {
                // SAFETY: `8 c + 8 <= dk <= MAX_HEAD` doubles of `q`.
                let q = unsafe { vld1q_f64_x4(q.as_ptr().add(8 * c)) };
                d[0] = vfmaq_f64(d[0], k[0], q.0);
                d[1] = vfmaq_f64(d[1], k[1], q.1);
                d[2] = vfmaq_f64(d[2], k[2], q.2);
                d[3] = vfmaq_f64(d[3], k[3], q.3);
            }
        }
        for (s, d) in s.iter_mut().zip(&d) {
            s[i] = vaddvq_f64(vaddq_f64(vaddq_f64(d[0], d[1]), vaddq_f64(d[2], d[3]))) as f32 * scale;
        }
    }
}

/// The value updates of one chunk of keys for dimensions `d..d + 8 W` of `R` rows' f16
/// accumulators (`acc16[r dv..]`): per key, `acc = f16(acc * ms)` where a row rescales (`any`),
/// then `acc = f16(fma(v, vs, acc))`, the accumulators in registers.
///
/// # Safety
/// Each row points at `dv` f16 values, `d + 8 W <= dv`, `acc16.len() >= R dv`,
/// `rows.len() <= KEY_CHUNK`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
#[inline]
unsafe fn multi_values<const R: usize, const W: usize>(
    acc16: &mut [F16Le],
    dv: usize,
    d: usize,
    rows: &[*const F16Le],
    ms: &[[f32; 4]; KEY_CHUNK],
    vs: &[[f32; 4]; KEY_CHUNK],
    any: &[bool; KEY_CHUNK],
) {
    let mut a = [[vdupq_n_u16(0); W]; R];
    for (r, a) in a.iter_mut().enumerate() {
        for (w, a) in a.iter_mut().enumerate() {
            *a = ld_f16x8(&acc16[r * dv + d + 8 * w..]);
        }
    }
    for (i, &p) in rows.iter().enumerate() {
        let mut v = [[vdupq_n_f32(0.0); 2]; W];
        for (w, v) in v.iter_mut().enumerate() {
            // SAFETY: `d + 8 w + 8 <= dv` values of the row (the caller's contract).
            let h = unsafe { vld1q_u16(p.add(d + 8 * w).cast()) };
            *v = [f16_lo(h), f16_hi(h)];
        }
        if any[i] {
            for (a, &m) in a.iter_mut().zip(&ms[i]) {
                for a in a.iter_mut() {
                    *a = rescale8(*a, m);
                }
            }
        }
        for (a, &x) in a.iter_mut().zip(&vs[i]) {
            for (a, v) in a.iter_mut().zip(&v) {
                *a = f16_narrow(vfmaq_n_f32(f16_lo(*a), v[0], x), vfmaq_n_f32(f16_hi(*a), v[1], x));
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (w, a) in a.iter().enumerate() {
            st_f16x8(&mut acc16[r * dv + d + 8 * w..], *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    /// `expf4` against `libm::expf` on every 61st f32 in [-110, 0] and the mask's edges.
    #[test]
    fn expf4_is_bit_identical_where_it_says_so() {
        let mut xs: Vec<f32> = (0..=110f32.to_bits()).step_by(61).map(|b| -f32::from_bits(b)).collect();
        xs.extend([0.0, -0.0, -86.0, -85.99999, -86.00001, -90.0, 1.0, f32::NEG_INFINITY, f32::NAN, -1e30]);
        xs.extend([0x42cf_f1b4u32, 0x42cf_f1b5, 0x42cf_f1b6].map(|b| -f32::from_bits(b)));
        xs.extend(
            [0x3f85_1592u32, 0x3f85_1593, 0x3eb1_7218, 0x3eb1_7219, 0x3900_0000, 0x3900_0001]
                .map(|b| -f32::from_bits(b)),
        );
        while xs.len() % 4 != 0 {
            xs.push(-1.0);
        }
        for x in xs.chunks_exact(4) {
            // SAFETY: NEON is part of the aarch64 baseline.
            let (e, ok) = unsafe { expf4(vld1q_f32(x.as_ptr())) };
            let (mut got, mut mask) = ([0f32; 4], [0u32; 4]);
            // SAFETY: writes 4 lanes each.
            unsafe {
                vst1q_f32(got.as_mut_ptr(), e);
                vst1q_u32(mask.as_mut_ptr(), ok);
            }
            for i in 0..4 {
                let want = libm::expf(x[i]);
                let exact = mask[i] != 0;
                let flushed = x[i] <= -f32::from_bits(0x42cf_f1b5);
                assert_eq!(exact, (-86.0..=0.0).contains(&x[i]) || flushed, "mask of {}", x[i]);
                assert!(
                    !exact || got[i].to_bits() == want.to_bits(),
                    "expf({}) = {} vs {}",
                    x[i],
                    got[i],
                    want
                );
            }
        }
    }
}
