// The cases of tc_kernel_check: the options a case sets (shapes, score terms,
// dtype, mode), its printed name, and the lists of its modes check, features
// and small. Host-only; their order and seeds are the driver's output, which
// is compared across trees and sessions, so a new case goes at the end of its
// list.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

// The dense mask's shape: (B, Hq, Sq, Sk) random blocks, (1, 1, Sq, Sk)
// random blocks, (B, 1, 1, Sk) key padding, (1, 1, Sq, Sk) causal.
enum class MaskKind { kNone, kFull, kShared, kPadding, kCausal };
inline const char* MaskName(MaskKind k) {
  switch (k) {
    case MaskKind::kNone: return "";
    case MaskKind::kFull: return " mask(B,H,T,S)";
    case MaskKind::kShared: return " mask(1,1,T,S)";
    case MaskKind::kPadding: return " mask(B,1,1,S)";
    case MaskKind::kCausal: return " mask=causal";
  }
  return "";
}

// The bias's shape (float32, the accumulation type): (B, Hq, Sq, Sk),
// per head (1, Hq, Sq, Sk), ALiBi-like (1, Hq, 1, Sk), per query (B, 1, Sq, 1)
// (softmax-invariant, its dbias is 0 up to rounding: it checks the key
// reduction of dbias and the scalar loads of a stride-0 key dimension).
enum class BiasKind { kNone, kFull, kHead, kAlibi, kRow };
inline const char* BiasName(BiasKind k) {
  switch (k) {
    case BiasKind::kNone: return "";
    case BiasKind::kFull: return " bias(B,H,T,S)";
    case BiasKind::kHead: return " bias(1,H,T,S)";
    case BiasKind::kAlibi: return " bias(1,H,1,S)";
    case BiasKind::kRow: return " bias(B,1,T,1)";
  }
  return "";
}

struct Case {
  int B, Sq, Sk, Hq, Hkv, D;
  bool causal = false;
  int wl = -1, wr = -1;
  bool lengths = false, segments = false;
  int seg_run = 23;       // segments change with probability 1 / seg_run per row
  bool tile_map = false;  // pass the tile map of segments and mask (cells empty, full, partial)
  bool block_mask = false;  // a random (1, 1, R, C) block mask, folded into the tile map
  float softcap = 0.f;
  bool bf16 = true;
  bool det = false;
  MaskKind mask = MaskKind::kNone;
  double dropout = 0;       // rate (the kernels round it to a multiple of 2^-8)
  bool key_per_batch = false;  // dropout keys (B, 2) instead of (1, 2)
  BiasKind bias = BiasKind::kNone;
  bool bias16 = false;  // the bias in the inputs' 16-bit dtype (else float32)
  std::string name() const {
    char buf[320];
    const std::string segs =
        (!segments ? "" : " segs" + (seg_run != 23 ? std::to_string(seg_run) : "")) +
        (tile_map ? " map" : "") + (block_mask ? " blocks" : "");
    std::snprintf(buf, sizeof buf, "%s B%d Sq%d Sk%d H%d/%d D%d%s%s%s%s%s%s%s%s%s", bf16 ? "bf16" : "fp16", B,
                  Sq, Sk, Hq, Hkv, D, causal ? " causal" : "",
                  (wl >= 0 || wr >= 0) ? (" win" + std::to_string(wl) + "," + std::to_string(wr)).c_str() : "",
                  lengths ? " lens" : "", segs.c_str(), softcap > 0 ? " cap" : "",
                  MaskName(mask), (std::string(BiasName(bias)) + (bias16 ? "16" : "")).c_str(),
                  dropout > 0 ? (" drop" + std::to_string(dropout).substr(0, 5) + (key_per_batch ? "/b" : "")).c_str() : "",
                  det ? " det" : "");
    return buf;
  }
};

// Dense masks and dropout, alone and with every other option, odd sizes,
// every bucket (d_split passes at 192 and 256), both dtypes, both modes.
// The bias (with dbias) in every shape kind, both modes, every bucket, and
// with the mask, dropout, causal, window, lengths, segments, softcap and
// GQA. Even Sk reads the bias as float2, odd Sk by scalars. The deterministic
// mode runs a bias on tensor cores when each dbias element has one writer
// (common/score.cuh's DbiasHasOneWriter: B = 1 or a per-batch bias, Hkv = 1
// or a per-head bias, and a per-key bias): those cases only.
inline void AddBiasCases(std::vector<Case>* cases) {
  const double kRate = 26.0 / 256;
  for (bool bf16 : {true, false})
    for (int D : {32, 64, 96, 128, 192, 256}) {
      Case c{2, 111, 143, 4, 2, D}; c.bf16 = bf16; c.bias = BiasKind::kFull; cases->push_back(c);
      c = Case{2, 130, 96, 4, 1, D}; c.bf16 = bf16; c.bias = BiasKind::kHead; c.causal = true;
      c.det = D % 64 == 0; c.B = c.det ? 1 : 2; cases->push_back(c);
    }
  const BiasKind kinds[] = {BiasKind::kFull, BiasKind::kHead, BiasKind::kAlibi, BiasKind::kRow};
  for (BiasKind kind : kinds) {
    Case c{2, 200, 230, 4, 2, 64}; c.bias = kind; cases->push_back(c);
    c = Case{2, 129, 257, 4, 1, 128}; c.bias = kind; c.dropout = 0.25; c.causal = true;
    cases->push_back(c);
    c = Case{2, 190, 211, 4, 2, 96}; c.bias = kind; c.mask = MaskKind::kFull; c.segments = true;
    c.lengths = true; c.softcap = 5.f; c.bf16 = false; cases->push_back(c);
    c = Case{1, 300, 300, 2, 2, 40}; c.bias = kind; c.wl = 50; c.wr = 3; c.dropout = kRate;
    c.mask = MaskKind::kPadding; cases->push_back(c);
    // Deterministic: one writer per dbias element (B = 1, Hkv = 1 for a
    // head-broadcast bias; a key-broadcast bias stays exact).
    if (kind != BiasKind::kRow) {
      c = Case{1, 170, 190, 4, 1, 64}; c.bias = kind; c.det = true; c.causal = true;
      c.dropout = kRate; cases->push_back(c);
      c = Case{1, 150, 97, 2, 2, 128}; c.bias = kind; c.det = true; c.softcap = 4.f;
      c.mask = MaskKind::kShared; cases->push_back(c);
    }
  }
  Case c{3, 64, 1000, 2, 1, 64}; c.bias = BiasKind::kAlibi; c.causal = true; c.lengths = true;
  cases->push_back(c);
  c = Case{2, 1, 77, 4, 4, 64}; c.bias = BiasKind::kFull; c.det = true; cases->push_back(c);
  c = Case{1, 333, 1, 2, 1, 32}; c.bias = BiasKind::kRow; c.det = true; cases->push_back(c);
}

// The Hopper forward's bias (sm90/bias_tile.cuh): tiles through TMA where
// the bias keeps its query and key dims and Sk is a multiple of 4 (several
// key blocks, partial last blocks in both dims, every bucket: D=192's stage
// does not fit and runs on sm_80), with the tile map's masks and segments,
// soft cap, lengths, windows and GQA; a bias broadcast over rows or keys
// (no TMA tiles) runs on sm_80 from the same dispatch.
inline void AddSm90BiasCases(std::vector<Case>* cases) {
  for (bool bf16 : {true, false})
    for (int D : {64, 96, 128, 192, 256}) {
      Case c{2, 300, 516, 4, 2, D}; c.bf16 = bf16; c.bias = BiasKind::kFull; cases->push_back(c);
      c = Case{1, 257, 384, 8, 2, D}; c.bf16 = bf16; c.bias = BiasKind::kHead; c.causal = true;
      cases->push_back(c);
    }
  Case c{2, 200, 260, 4, 2, 128}; c.bias = BiasKind::kHead; c.mask = MaskKind::kFull;
  c.tile_map = true; cases->push_back(c);
  c = Case{2, 384, 384, 4, 2, 64}; c.bias = BiasKind::kFull; c.segments = true; c.seg_run = 150;
  c.tile_map = true; c.causal = true; cases->push_back(c);
  c = Case{2, 140, 132, 4, 1, 256}; c.bias = BiasKind::kHead; c.softcap = 5.f; c.lengths = true;
  cases->push_back(c);
  c = Case{1, 260, 300, 2, 2, 96}; c.bias = BiasKind::kFull; c.wl = 70; c.wr = 9; c.bf16 = false;
  cases->push_back(c);
  c = Case{3, 1, 1000, 4, 2, 64}; c.bias = BiasKind::kFull; cases->push_back(c);
  c = Case{2, 150, 200, 4, 2, 128}; c.bias = BiasKind::kAlibi; cases->push_back(c);
  c = Case{2, 150, 200, 4, 2, 64}; c.bias = BiasKind::kRow; c.causal = true; cases->push_back(c);
}

// A bias in the inputs' 16-bit dtype, read as it is by every family: the
// Hopper forwards' 16-bit TMA tiles (64 keys per box; Sk a multiple of 8,
// every bucket but D=192, whose 96-key blocks are not whole boxes), and the
// mma.sync kernels' per-element reads (BiasView) in the backward, in D=192's
// forward, for Sk not a multiple of 8 (scalar loads where Sk is odd), a bias
// broadcast over rows or keys, with dropout; the deterministic dbias.
inline void AddBias16Cases(std::vector<Case>* cases) {
  const double kRate = 26.0 / 256;
  for (bool bf16 : {true, false})
    for (int D : {64, 96, 128, 192, 256}) {
      Case c{2, 300, 520, 4, 2, D}; c.bf16 = bf16; c.bias = BiasKind::kFull; c.bias16 = true;
      cases->push_back(c);
      c = Case{1, 257, 384, 8, 2, D}; c.bf16 = bf16; c.bias = BiasKind::kHead; c.causal = true;
      c.bias16 = true; cases->push_back(c);
    }
  const BiasKind kinds[] = {BiasKind::kFull, BiasKind::kHead, BiasKind::kAlibi, BiasKind::kRow};
  for (BiasKind kind : kinds) {
    Case c{2, 200, 230, 4, 2, 64}; c.bias = kind; c.bias16 = true; cases->push_back(c);
    c = Case{2, 129, 257, 4, 1, 128}; c.bias = kind; c.dropout = 0.25; c.causal = true;
    c.bias16 = true; c.bf16 = false; cases->push_back(c);
    c = Case{2, 190, 256, 4, 2, 96}; c.bias = kind; c.mask = MaskKind::kFull; c.segments = true;
    c.tile_map = true; c.lengths = true; c.softcap = 5.f; c.bias16 = true; cases->push_back(c);
    if (kind != BiasKind::kRow) {
      c = Case{1, 150, 97, 2, 2, 128}; c.bias = kind; c.det = true; c.softcap = 4.f;
      c.dropout = kRate; c.bias16 = true; cases->push_back(c);
    }
  }
  Case c{3, 1, 1000, 4, 2, 64}; c.bias = BiasKind::kFull; c.bias16 = true; cases->push_back(c);
  c = Case{1, 333, 1, 2, 1, 32}; c.bias = BiasKind::kRow; c.det = true; c.bias16 = true;
  cases->push_back(c);
}

inline void AddFeatureCases(std::vector<Case>* cases) {
  const double kRate = 26.0 / 256;  // 0.1, as a multiple of 2^-8
  for (bool bf16 : {true, false})
    for (int D : {32, 64, 96, 128, 192, 256}) {
      Case c{2, 111, 143, 4, 2, D}; c.bf16 = bf16; c.dropout = kRate; cases->push_back(c);
      c = Case{1, 150, 97, 2, 1, D}; c.bf16 = bf16; c.mask = MaskKind::kFull; c.causal = true;
      cases->push_back(c);
    }
  const MaskKind kinds[] = {MaskKind::kFull, MaskKind::kShared, MaskKind::kPadding,
                            MaskKind::kCausal};
  for (MaskKind kind : kinds)
    for (bool det : {false, true}) {
      Case c{2, 200, 230, 4, 2, 64}; c.mask = kind; c.det = det; cases->push_back(c);
      c = Case{2, 129, 257, 4, 1, 128}; c.mask = kind; c.det = det; c.dropout = 0.25;
      c.causal = true; cases->push_back(c);
      c = Case{1, 300, 300, 2, 2, 40}; c.mask = kind; c.det = det; c.wl = 50; c.wr = 3;
      c.bf16 = false; cases->push_back(c);
      // Key counts of 16-byte mask rows: the forward stages the mask (and
      // the bias) per warp (common/term_slab.cuh); 208 ends in a partial
      // key block, 131 and 77 in partial query blocks.
      c = Case{2, 131, 208, 4, 2, 64}; c.mask = kind; c.det = det; cases->push_back(c);
      c = Case{2, 77, 96, 4, 1, 128}; c.mask = kind; c.det = det; c.causal = true;
      if (!det) c.bias = BiasKind::kFull;
      cases->push_back(c);
    }
  Case c{3, 170, 190, 4, 2, 128}; c.dropout = kRate; c.causal = true; c.lengths = true;
  cases->push_back(c);
  c = Case{2, 190, 210, 2, 2, 64}; c.dropout = 0.5; c.segments = true; c.softcap = 4.f;
  cases->push_back(c);
  c = Case{2, 190, 210, 4, 2, 96}; c.dropout = kRate; c.segments = true; c.mask = MaskKind::kFull;
  c.lengths = true; c.det = true; cases->push_back(c);
  c = Case{2, 300, 300, 4, 1, 64}; c.dropout = kRate; c.wl = 37; c.wr = 5; c.key_per_batch = true;
  cases->push_back(c);
  c = Case{1, 1000, 1000, 2, 1, 128}; c.dropout = kRate; c.causal = true; c.det = true;
  cases->push_back(c);
  c = Case{4, 64, 64, 2, 2, 64}; c.dropout = 0.9; c.key_per_batch = true; cases->push_back(c);
  c = Case{1, 1, 300, 2, 1, 64}; c.dropout = kRate; c.mask = MaskKind::kShared; cases->push_back(c);
  c = Case{1, 150, 160, 4, 2, 192}; c.dropout = kRate; c.softcap = 3.f; c.mask = MaskKind::kCausal;
  c.bf16 = false; cases->push_back(c);
  AddBiasCases(cases);
  AddSm90BiasCases(cases);
  AddBias16Cases(cases);
  // Dropout on the wgmma kernels of every Hopper bucket (the dK/dV kernel's
  // keys x queries draws, the dQ kernel's queries x keys ones): both modes,
  // causal, GQA, partial blocks. (Last, so that the cases above keep their
  // seeds.)
  for (int D : {64, 96, 128, 192, 256})
    for (bool det : {false, true}) {
      c = Case{2, 200, 333, 4, 2, D}; c.dropout = kRate; c.causal = true; c.det = det;
      cases->push_back(c);
    }
  // Dropout over more tiles than an H100 has SMs (256): the persistent
  // warp-specialized forward walks several per CTA, many key blocks each,
  // causal and GQA.
  c = Case{4, 1024, 1024, 8, 8, 64}; c.dropout = kRate; cases->push_back(c);
  c = Case{4, 1024, 1536, 8, 2, 128}; c.dropout = kRate; c.causal = true; cases->push_back(c);
}

// The tile map of segment ids (cells of 128 x 128 positions: empty ones
// skipped, full ones without the per-element test): long segments so that
// every class appears, every bucket (D = 192's key blocks of 96 straddle
// cells: no map there), both modes, with the band, lengths, GQA, softcap and
// the score terms; one segment (all full) and short ones (all partial).
inline void AddTileMapCases(std::vector<Case>* cases) {
  for (int D : {64, 128, 192, 256})
    for (bool det : {false, true}) {
      Case c{2, 700, 650, 4, 2, D}; c.segments = true; c.seg_run = 300; c.tile_map = true;
      c.det = det; c.causal = !det; c.bf16 = D != 128 || det; cases->push_back(c);
      c = Case{1, 900, 900, 2, 1, D}; c.segments = true; c.seg_run = 250; c.tile_map = true;
      c.det = det; c.lengths = true; c.wl = 400; c.wr = 100; cases->push_back(c);
    }
  Case c{1, 1000, 1000, 4, 4, 128}; c.segments = true; c.seg_run = 100000; c.tile_map = true;
  c.causal = true; cases->push_back(c);  // one segment: every cell full
  c = Case{2, 300, 400, 2, 1, 64}; c.segments = true; c.seg_run = 5; c.tile_map = true;
  cases->push_back(c);  // short segments: every cell partial
  c = Case{2, 600, 500, 4, 2, 64}; c.segments = true; c.seg_run = 200; c.tile_map = true;
  c.softcap = 3.f; c.causal = true; cases->push_back(c);
  c = Case{2, 500, 600, 4, 2, 128}; c.segments = true; c.seg_run = 200; c.tile_map = true;
  c.mask = MaskKind::kFull; c.dropout = 26.0 / 256; cases->push_back(c);  // kTerms kernels
  c = Case{1, 400, 450, 2, 1, 96}; c.segments = true; c.seg_run = 150; c.tile_map = true;
  c.bias = BiasKind::kHead; cases->push_back(c);
  // A dense mask with its tile map: the Hopper forward on wgmma (sm90/fwd.cuh),
  // the backward on mma.sync.
  for (MaskKind kind : {MaskKind::kCausal, MaskKind::kPadding, MaskKind::kFull, MaskKind::kShared})
    for (int D : {64, 128, 256}) {
      c = Case{2, 600, 550, 4, 2, D}; c.mask = kind; c.tile_map = true; c.bf16 = D != 64;
      c.segments = kind == MaskKind::kPadding; c.seg_run = 250; cases->push_back(c);
    }
  c = Case{1, 700, 700, 2, 1, 192}; c.mask = MaskKind::kCausal; c.tile_map = true; c.wl = 300;
  cases->push_back(c);  // D = 192: no map line (96-key blocks), every block partial
  c = Case{2, 300, 300, 4, 4, 128}; c.mask = MaskKind::kCausal; c.tile_map = true; c.lengths = true;
  c.softcap = 3.f; c.det = true; cases->push_back(c);
  // Block-sparse masks through the tile map (Hopper: wgmma; the mma.sync
  // kTerms kernels elsewhere, and on Hopper for D = 192, whose wgmma
  // forward's 96-key blocks straddle cells), alone and with causal, window,
  // segments, a dense mask, GQA, both modes.
  for (int D : {64, 96, 128, 192, 256})
    for (bool det : {false, true}) {
      c = Case{2, 700, 650, 4, 2, D}; c.block_mask = true; c.tile_map = true; c.det = det;
      c.causal = det; c.bf16 = D != 96; cases->push_back(c);
    }
  c = Case{2, 600, 700, 4, 1, 128}; c.block_mask = true; c.tile_map = true; c.segments = true;
  c.seg_run = 300; c.mask = MaskKind::kPadding; cases->push_back(c);
  c = Case{1, 1000, 1000, 2, 2, 64}; c.block_mask = true; c.tile_map = true; c.wl = 200; c.wr = 0;
  cases->push_back(c);
}

// check: the score terms (AddFeatureCases), then every bucket and option
// without them.
inline void AddCheckCases(std::vector<Case>* cases) {
  AddFeatureCases(cases);
  for (bool bf16 : {true, false})
    for (int D : {40, 64, 72, 120, 128, 256}) {
      Case c{2, 127, 127, 4, 4, D}; c.bf16 = bf16; cases->push_back(c);
      c = Case{1, 1, 300, 2, 1, D}; c.bf16 = bf16; cases->push_back(c);
      c = Case{2, 1000, 513, 4, 2, D}; c.bf16 = bf16; c.causal = true; cases->push_back(c);
    }
  for (int D : {32, 96, 192, 8, 16, 256}) { Case c{1, 17, 129, 3, 1, D}; c.causal = true; cases->push_back(c); }
  Case c{2, 300, 300, 4, 1, 64}; c.wl = 37; c.wr = 5; cases->push_back(c);
  c = Case{3, 200, 250, 4, 2, 128}; c.lengths = true; c.causal = true; cases->push_back(c);
  c = Case{2, 190, 210, 2, 2, 64}; c.segments = true; cases->push_back(c);
  c = Case{2, 190, 210, 2, 2, 128}; c.segments = true; c.lengths = true; c.causal = true; cases->push_back(c);
  c = Case{1, 150, 160, 4, 2, 96}; c.softcap = 3.f; cases->push_back(c);
  c = Case{1, 150, 160, 4, 2, 192}; c.softcap = 3.f; c.causal = true; c.bf16 = false; cases->push_back(c);
  c = Case{1, 150, 160, 4, 2, 128}; c.softcap = 3.f; c.wl = 20; c.wr = 7; cases->push_back(c);
  c = Case{1, 40, 200, 2, 1, 64}; c.wl = 0; c.wr = 0; cases->push_back(c);  // many masked blocks
  c = Case{2, 100, 30, 2, 2, 64}; c.causal = true; c.wl = 3; c.wr = 0; cases->push_back(c);
  c = Case{1, 1000, 1000, 2, 1, 128}; c.causal = true; c.det = true; cases->push_back(c);
  c = Case{2, 127, 300, 4, 2, 72}; c.det = true; c.segments = true; cases->push_back(c);
  c = Case{1, 129, 65, 2, 2, 256}; c.det = true; c.softcap = 2.f; cases->push_back(c);
  c = Case{2, 300, 129, 2, 1, 40}; c.det = true; c.lengths = true; c.bf16 = false; cases->push_back(c);
  c = Case{1, 64, 0, 2, 2, 64}; cases->push_back(c);  // no keys: out 0, lse -inf
  // More tiles than SMs (the Hopper forward's persistent grid): several
  // per CTA, the ring's phases wrapping across tiles.
  c = Case{2, 600, 650, 24, 8, 64}; cases->push_back(c);
  c = Case{1, 900, 900, 24, 6, 128}; c.causal = true; cases->push_back(c);
  c = Case{2, 500, 700, 20, 4, 128}; c.lengths = true; c.wl = 300; c.wr = 40; cases->push_back(c);
  c = Case{2, 400, 400, 20, 20, 120}; c.segments = true; c.softcap = 4.f; c.bf16 = false;
  cases->push_back(c);
  // The buckets 96, 192 and 256 (Hopper: TMA forwards; K/V blocks of 128, 96
  // and 64 keys): head dims inside each bucket, every mask kind, GQA.
  for (int D : {72, 96, 136, 192, 200, 256}) {
    c = Case{2, 257, 300, 4, 2, D}; c.causal = true; c.bf16 = D % 3 != 0; cases->push_back(c);
    c = Case{1, 190, 333, 6, 2, D}; c.wl = 50; c.wr = 10; cases->push_back(c);
    c = Case{3, 129, 200, 2, 1, D}; c.lengths = true; c.segments = true; cases->push_back(c);
  }
  c = Case{1, 200, 200, 2, 2, 256}; c.softcap = 4.f; c.causal = true; c.bf16 = false; cases->push_back(c);
  c = Case{2, 1, 700, 4, 1, 192}; cases->push_back(c);  // one query row, many key blocks
  // One key (P = 1: dS, dQ and dK must come out 0 up to the D-vs-dP
  // rounding, cpp/cuda/NOTES.md) and one query, both modes, D 192 and 256.
  for (int D : {192, 256})
    for (bool det : {false, true}) {
      c = Case{1, 300, 1, 2, 1, D}; c.det = det; cases->push_back(c);
      if (D == 256 || det) { c = Case{2, 1, 700, 4, 1, D}; c.det = det; cases->push_back(c); }
    }
  c = Case{2, 77, 0, 2, 2, 192}; cases->push_back(c);    // no keys: out 0, lse -inf, dq 0
  // The deterministic backward (Hopper: the wgmma dK/dV without dQ, then
  // the wgmma dQ kernel), every bucket, bitwise reproducible.
  for (int D : {48, 96, 128, 160, 256}) {
    c = Case{2, 200, 333, 4, 2, D}; c.det = true; c.causal = true; c.bf16 = D != 96; cases->push_back(c);
    c = Case{1, 129, 64, 2, 1, D}; c.det = true; c.segments = true; c.softcap = 2.5f; cases->push_back(c);
  }
  AddTileMapCases(cases);
  // Causal with 32 or more key blocks of 128: the Hopper backward's 64 MB
  // sections, two of them (10 pairs, then 2); the key blocks past Sq see no
  // query (dK, dV 0).
  c = Case{1, 4000, 4500, 24, 12, 96}; c.causal = true; cases->push_back(c);
  // The D = 64 forward's light kernels (sm90/fwd_ws.cuh) with 192-row tiles:
  // causal from 2048 query rows on (fewer keep 128-row tiles), Sq != Sk,
  // partial tiles, GQA, both dtypes.
  c = Case{1, 2100, 2300, 4, 2, 64}; c.causal = true; cases->push_back(c);
  c = Case{2, 2049, 1900, 2, 1, 64}; c.causal = true; c.bf16 = false; cases->push_back(c);
  // ... and with dropout (non-causal from 2048 rows: the kEnds kernel's
  // dropout instantiation).
  c = Case{1, 2100, 2200, 4, 2, 64}; c.dropout = 26.0 / 256; cases->push_back(c);
  // ... causal with dropout: kBand's kernel, or with the tuning hook
  // WS_CAUSAL_LIGHT_DROPOUT the causal light kernel on the 192-row tile,
  // counted from the last row (shifts 112 and 176 rows: tiles with
  // warpgroups wholly and partly before row 0).
  c = Case{1, 2192, 2300, 4, 2, 64}; c.causal = true; c.dropout = 26.0 / 256; cases->push_back(c);
  c = Case{2, 2320, 1900, 2, 1, 64}; c.causal = true; c.dropout = 0.25; c.lengths = true;
  c.bf16 = false; cases->push_back(c);
  // ... and with lengths (one batch element hides everything).
  c = Case{2, 300, 410, 4, 2, 64}; c.lengths = true; cases->push_back(c);
  c = Case{2, 2100, 2000, 2, 1, 64}; c.causal = true; c.lengths = true; c.bf16 = false;
  cases->push_back(c);
  // The D = 128 backward's 80-query steps (no mask beyond the ends; dQ
  // transposed): a partial last step, GQA, more key blocks than SMs (the
  // persistent CTAs take several), lengths, Sq != Sk, both dtypes.
  c = Case{2, 1000, 1300, 16, 4, 128}; cases->push_back(c);
  c = Case{3, 250, 200, 4, 2, 128}; c.lengths = true; c.bf16 = false; cases->push_back(c);
  c = Case{1, 81, 257, 2, 1, 112}; cases->push_back(c);
  // The D = 256 forward's light kernel (128 x 80 tiles, no mask beyond the
  // ends): many key blocks and a partial last one, GQA, lengths, D = 200 in
  // the bucket, both dtypes.
  c = Case{2, 300, 1000, 8, 2, 256}; cases->push_back(c);
  c = Case{1, 130, 250, 2, 1, 200}; c.lengths = true; c.bf16 = false; cases->push_back(c);
  // D = 128 causal on the 80-query steps (plain_causal: Sq != Sk, steps
  // across the diagonal), and for the tuning hook WS_LIGHT_TILE_DROPOUT
  // (D = 256 dropout on the 80-key tile, tall enough for it:
  // kLightMinRows), which main runs on its usual kernels.
  c = Case{1, 700, 900, 4, 2, 128}; c.causal = true; cases->push_back(c);
  c = Case{2, 333, 300, 2, 2, 128}; c.causal = true; c.lengths = true; c.bf16 = false;
  cases->push_back(c);
  c = Case{1, 2100, 400, 2, 1, 256}; c.dropout = 0.25; cases->push_back(c);
  // D = 128 dropout on its own tile (FwdWsDropoutTileSize: 192 x 64, three
  // consumer warpgroups, non-causal calls from kLightMinRows query rows): a
  // partial last tile, Sq != Sk, GQA, lengths, both dtypes; causal, a
  // window with segments and a tile map take kBand's kernel (controls).
  c = Case{1, 2100, 1300, 4, 2, 128}; c.dropout = 26.0 / 256; cases->push_back(c);
  c = Case{2, 2049, 2200, 2, 1, 128}; c.dropout = 0.25; c.lengths = true; c.bf16 = false;
  cases->push_back(c);
  c = Case{2, 2049, 2200, 2, 1, 128}; c.dropout = 0.25; c.causal = true; c.lengths = true;
  cases->push_back(c);
  c = Case{1, 2200, 900, 2, 2, 112}; c.dropout = 26.0 / 256; c.segments = true; c.wl = 300;
  c.wr = 40; cases->push_back(c);
  c = Case{1, 2100, 600, 2, 1, 128}; c.dropout = 0.25; c.segments = true; c.seg_run = 300;
  c.tile_map = true; cases->push_back(c);
  // ... with more tiles than SMs (352: a CTA takes several, its rings and
  // O staging tile carried from one to the next).
  c = Case{2, 2100, 1300, 16, 4, 128}; c.dropout = 26.0 / 256; cases->push_back(c);
  // D = 256's out staged over the V ring (FwdWsSmem::kOOverV) with more tiles
  // than SMs, so that a CTA's tiles follow one another through barrier_o:
  // kEnds' 128 x 80 tile, causal, lengths with a batch hidden (tiles without
  // keys between tiles with), dropout; both dtypes.
  c = Case{2, 2100, 1300, 8, 2, 256}; cases->push_back(c);
  c = Case{2, 2100, 1300, 8, 2, 256}; c.causal = true; c.bf16 = false; cases->push_back(c);
  c = Case{3, 1500, 900, 8, 2, 256}; c.lengths = true; cases->push_back(c);
  c = Case{2, 1100, 700, 16, 4, 256}; c.dropout = 0.25; c.bf16 = false; cases->push_back(c);
  // ... and kBand's kernel skipping key blocks by the tile map (segments),
  // and the dense mask's kernel, more tiles than SMs.
  c = Case{2, 1100, 700, 16, 4, 256}; c.segments = true; c.seg_run = 300; c.tile_map = true;
  cases->push_back(c);
  c = Case{2, 1100, 700, 16, 4, 256}; c.mask = MaskKind::kPadding; c.bf16 = false;
  cases->push_back(c);
  // The persistent backward (non-causal, no window) with more key-block
  // tiles than SMs (2 x 8 kv heads x 9 blocks = 144): a CTA takes several,
  // so its dK / dV epilogue meets the next tile's first steps; the last key
  // block holds 6 keys (its second warpgroup none). GQA, a tile map,
  // dropout, the deterministic mode, D = 112 in fp16, D = 64.
  c = Case{2, 600, 1030, 16, 8, 128}; cases->push_back(c);
  c = Case{2, 600, 1030, 16, 8, 128}; c.segments = true; c.seg_run = 300; c.tile_map = true;
  cases->push_back(c);
  c = Case{2, 600, 1030, 16, 8, 128}; c.dropout = 0.25; cases->push_back(c);
  c = Case{2, 600, 1030, 16, 8, 128}; c.det = true; cases->push_back(c);
  c = Case{2, 600, 1030, 16, 8, 112}; c.bf16 = false; cases->push_back(c);
  c = Case{2, 600, 1030, 16, 8, 64}; cases->push_back(c);
  // The ws forward's causal kernels count their tiles from the last row
  // (TileRowShift: the first tile starts before row 0, a multiple of 16
  // rows): D = 64's 192-row light tile from 2048 rows (shifts 64, 128, 0 with
  // 4 rows past the end; lengths; Sq > Sk and Sq < Sk; more tiles than SMs),
  // the 128-row causal kernels (D = 64 below 2048 rows, D = 128) with
  // seqlen_q not a multiple of 128.
  c = Case{2, 2048, 2048, 2, 1, 64}; c.causal = true; cases->push_back(c);
  c = Case{1, 4096, 4096, 2, 1, 64}; c.causal = true; c.bf16 = false; cases->push_back(c);
  c = Case{2, 2100, 2100, 4, 2, 64}; c.causal = true; c.lengths = true; cases->push_back(c);
  c = Case{1, 4000, 3000, 2, 1, 64}; c.causal = true; cases->push_back(c);
  c = Case{1, 3000, 4100, 2, 1, 64}; c.causal = true; c.bf16 = false; cases->push_back(c);
  c = Case{2, 2300, 2300, 16, 4, 64}; c.causal = true; cases->push_back(c);
  c = Case{2, 1100, 1100, 16, 4, 64}; c.causal = true; cases->push_back(c);
  c = Case{2, 1100, 1100, 16, 4, 128}; c.causal = true; c.lengths = true; cases->push_back(c);
  // ... a first tile of 17 real rows (2113: 176 rows before row 0, two
  // warpgroups' stores wholly below it), D = 256's out over V with a
  // warpgroup below row 0, one query row, one key.
  c = Case{2, 2113, 2113, 2, 1, 64}; c.causal = true; cases->push_back(c);
  c = Case{2, 300, 300, 4, 2, 256}; c.causal = true; cases->push_back(c);
  c = Case{2, 40, 100, 4, 2, 256}; c.causal = true; c.bf16 = false; cases->push_back(c);
  // ... one warpgroup straddling row 0 (through the threads, arriving on
  // barrier_o) beside one staging over V (200 rows: 48 before row 0).
  c = Case{2, 200, 300, 4, 2, 256}; c.causal = true; cases->push_back(c);
  c = Case{3, 1, 300, 4, 2, 128}; c.causal = true; cases->push_back(c);
  c = Case{3, 1, 300, 4, 4, 64}; c.causal = true; cases->push_back(c);
  c = Case{1, 2100, 1, 2, 1, 64}; c.causal = true; cases->push_back(c);
  // D = 128 causal dropout on the 192-row dropout tile, counted from the
  // last row (shifts 0 with 12 rows past the end, 0, 96 with lengths; GQA;
  // D = 112 in fp16).
  c = Case{1, 2100, 2100, 4, 2, 128}; c.causal = true; c.dropout = 0.25; cases->push_back(c);
  c = Case{1, 2304, 2000, 2, 1, 128}; c.causal = true; c.dropout = 26.0 / 256; cases->push_back(c);
  c = Case{2, 2200, 2300, 2, 1, 112}; c.causal = true; c.dropout = 0.25; c.lengths = true;
  c.bf16 = false; cases->push_back(c);
}

// small (for compute-sanitizer): a few cases of each kernel family, each
// with its own seed.
struct SeededCase {
  Case c;
  uint64_t seed;
};
inline std::vector<SeededCase> SmallCases() {
  std::vector<SeededCase> s;
  Case c{2, 77, 45, 4, 2, 72}; c.causal = true; c.lengths = true; s.push_back({c, 1});
  c = Case{1, 33, 130, 2, 1, 64}; c.segments = true; c.softcap = 5; s.push_back({c, 2});
  c = Case{1, 65, 65, 2, 2, 128}; c.det = true; s.push_back({c, 3});
  c = Case{1, 70, 90, 4, 2, 128}; c.causal = true; s.push_back({c, 4});  // Hopper: wgmma bwd
  c = Case{2, 77, 45, 4, 2, 72}; c.causal = true; c.dropout = 0.25; c.mask = MaskKind::kFull;
  s.push_back({c, 5});
  c = Case{1, 65, 100, 2, 1, 64}; c.det = true; c.dropout = 0.25; c.segments = true;
  c.mask = MaskKind::kShared; s.push_back({c, 6});
  c = Case{1, 40, 70, 2, 2, 256}; c.dropout = 0.25; c.mask = MaskKind::kPadding; s.push_back({c, 7});
  // More tiles (2 x 40 heads x 2 query blocks) than an H100 has SMs: the
  // persistent forward's CTAs take several, empty ones (length 0) among them.
  c = Case{2, 129, 70, 40, 8, 64}; c.causal = true; c.lengths = true; s.push_back({c, 8});
  c = Case{2, 77, 46, 4, 2, 64}; c.bias = BiasKind::kFull; c.causal = true; s.push_back({c, 9});
  c = Case{1, 65, 100, 4, 1, 128}; c.det = true; c.bias = BiasKind::kAlibi; c.dropout = 0.25;
  s.push_back({c, 10});
  c = Case{2, 50, 70, 2, 2, 64}; c.bias = BiasKind::kRow; c.softcap = 5; s.push_back({c, 11});
  // Hopper: every bucket's wgmma kernels (TMA forwards, several K/V blocks
  // and a partial last one; the backward above D = 128 splitting the head
  // dim; the deterministic dQ kernel).
  c = Case{1, 130, 140, 2, 1, 80}; c.causal = true; s.push_back({c, 16});
  c = Case{1, 70, 200, 2, 2, 176}; c.lengths = true; c.bf16 = false; s.push_back({c, 17});
  c = Case{2, 65, 150, 2, 1, 256}; c.segments = true; s.push_back({c, 18});
  c = Case{1, 140, 70, 2, 1, 96}; c.det = true; c.softcap = 3.f; s.push_back({c, 19});
  c = Case{1, 131, 130, 2, 2, 192}; c.det = true; c.causal = true; s.push_back({c, 20});
  c = Case{1, 70, 129, 2, 1, 256}; c.det = true; c.wl = 20; c.wr = 20; s.push_back({c, 21});
  c = Case{1, 50, 90, 2, 2, 64}; c.det = true; c.lengths = true; s.push_back({c, 22});
  // The forward's staged terms (16-byte rows; a batch-broadcast bias:
  // batch-innermost CTAs; a partial last key block).
  c = Case{2, 40, 96, 4, 2, 64}; c.bias = BiasKind::kHead; c.mask = MaskKind::kShared;
  c.causal = true; s.push_back({c, 23});
  c = Case{1, 70, 208, 2, 1, 128}; c.bias = BiasKind::kFull; c.mask = MaskKind::kFull;
  c.dropout = 0.25; s.push_back({c, 24});
  // The tile map: empty, full and partial cells, the forward and both
  // backward modes.
  c = Case{1, 300, 280, 2, 1, 64}; c.segments = true; c.seg_run = 150; c.tile_map = true;
  c.causal = true; s.push_back({c, 25});
  c = Case{1, 280, 300, 2, 2, 128}; c.segments = true; c.seg_run = 150; c.tile_map = true;
  c.det = true; s.push_back({c, 26});
  c = Case{1, 300, 280, 2, 1, 128}; c.mask = MaskKind::kCausal; c.tile_map = true;
  s.push_back({c, 27});
  c = Case{1, 400, 300, 2, 1, 64}; c.block_mask = true; c.tile_map = true; s.push_back({c, 28});
  // The Hopper forward's TMA-staged bias: several key blocks, partial last
  // ones, with a dense mask and its tile map.
  c = Case{1, 140, 264, 2, 1, 128}; c.bias = BiasKind::kFull; s.push_back({c, 29});
  c = Case{2, 70, 200, 4, 2, 64}; c.bias = BiasKind::kHead; c.mask = MaskKind::kFull;
  c.tile_map = true; c.causal = true; s.push_back({c, 30});
  // A 16-bit bias: the Hopper forwards' 16-bit tiles, the backward's reads.
  c = Case{1, 140, 264, 2, 1, 128}; c.bias = BiasKind::kFull; c.bias16 = true; s.push_back({c, 31});
  c = Case{2, 70, 200, 4, 2, 64}; c.bias = BiasKind::kHead; c.bias16 = true; c.bf16 = false;
  c.causal = true; s.push_back({c, 32});
  c = Case{1, 90, 200, 2, 1, 256}; c.bias = BiasKind::kHead; c.bias16 = true; s.push_back({c, 33});
  // Dropout on the wgmma kernels: the warp-specialized forward and the
  // dK/dV kernel with dQ (D = 64), the deterministic structure (D = 128),
  // sm90/fwd.cuh with the wide backward (D = 256), a dense mask's tile map.
  c = Case{2, 140, 200, 4, 2, 64}; c.dropout = 0.25; c.causal = true; s.push_back({c, 34});
  c = Case{1, 130, 140, 2, 1, 128}; c.dropout = 0.25; c.det = true; s.push_back({c, 35});
  c = Case{1, 70, 150, 2, 2, 256}; c.dropout = 0.25; c.causal = true; s.push_back({c, 36});
  c = Case{1, 300, 280, 2, 1, 96}; c.dropout = 0.25; c.mask = MaskKind::kCausal;
  c.tile_map = true; s.push_back({c, 37});
  // The D = 64 forward's light kernels (192-row tiles, three consumer
  // warpgroups): plain, causal from 2048 query rows, dropout (non-causal,
  // from 2048 rows), lengths.
  c = Case{2, 200, 300, 4, 2, 64}; s.push_back({c, 38});
  c = Case{1, 2049, 2100, 2, 1, 64}; c.causal = true; c.bf16 = false; s.push_back({c, 39});
  c = Case{1, 2049, 300, 2, 1, 64}; c.dropout = 0.25; s.push_back({c, 40});
  c = Case{2, 200, 300, 4, 2, 64}; c.lengths = true; s.push_back({c, 41});
  // The D = 128 backward's 80-query steps (dQ transposed), a partial last one.
  c = Case{1, 170, 130, 4, 2, 128}; s.push_back({c, 42});
  // The D = 256 forward's light kernel (80-key blocks), a partial last one.
  c = Case{1, 140, 250, 2, 1, 256}; s.push_back({c, 43});
  // D = 128 dropout on its 192 x 64 tile (three consumer warpgroups).
  c = Case{1, 2050, 130, 2, 1, 128}; c.dropout = 0.25; c.lengths = true; s.push_back({c, 44});
  // D = 256's out over the V ring with more tiles than SMs (240): with seed
  // 46's lengths, tiles with keys are also handed out after a CTA's first
  // (its barrier_o wait), one batch's tiles have none.
  c = Case{3, 129, 70, 40, 8, 256}; c.lengths = true; s.push_back({c, 46});
  // The persistent D = 128 backward with more tiles than SMs (2 x 70 heads
  // x 2 key blocks = 280), plain and with dropout: a CTA's tiles follow one
  // another (the dK / dV epilogue, the next tile's first loads).
  c = Case{2, 65, 130, 70, 70, 128}; s.push_back({c, 48});
  c = Case{2, 65, 130, 70, 70, 128}; c.dropout = 0.25; s.push_back({c, 49});
  // The ws forward's causal tiles counted from the last row: D = 64's
  // 192-row tile (2048 rows: the first tile starts 64 rows before row 0),
  // and a 128-row one (D = 128, 200 rows: 48 before, 8 past the end).
  c = Case{1, 2048, 2048, 2, 1, 64}; c.causal = true; s.push_back({c, 50});
  c = Case{2, 200, 300, 4, 2, 128}; c.causal = true; s.push_back({c, 51});
  // D = 128 causal dropout on its 192-row tile (from 2048 rows).
  c = Case{1, 2050, 2050, 2, 1, 128}; c.causal = true; c.dropout = 0.25; s.push_back({c, 52});
  return s;
}
