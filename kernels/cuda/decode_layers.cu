// Every decoder layer of one decode token (batch 1) of a Qwen3-MoE-shaped model in one persistent launch.
//
// Host side, plan, numerics and the measured reasons: kernels/decode_megakernel.py; results and what is
// left: docs/gpu.md, "The decode megakernel". In short: one CTA per SM for the whole step, eight consumer
// warps and one producer warp. Each CTA owns fixed slices of every projection (QKV rows, o-proj rows, its
// router rows, expert rows); the producer streams them from HBM into an 8-stage shared-memory ring with
// bulk copies (cp.async.bulk on an mbarrier), in the order the layer consumes them, as far ahead as the
// ring allows (the experts wait for routing). A layer's values pass between CTAs through "LL" words in
// global memory: each 32-bit word carries a bf16 value and a 16-bit flag (a 64-bit word: a float32 and a
// 32-bit flag), stored and loaded whole, so a reader polls the data itself and needs no separate counter,
// fence or barrier (NCCL's low-latency protocol). A flag names the launch (an epoch counter in device
// memory, advanced by the last CTA to leave) and the layer, so a word from the previous layer or step never
// passes for a current one.
//
// Phases of a layer (CTA c of G; every CTA takes part in each all-to-all exchange, which is what orders
// the reuse of every buffer):
//   P1  residual add, input norm, QKV rows                         -> qkv    (LL4)
//   P2  attention of one KV head over one split of the context     -> partial o, lse (LL8)
//   P2b merge of the splits, one (q head, 32 dims) unit per CTA    -> attn   (LL4)
//   P3  o-proj rows + residual                                     -> h      (LL4)
//   P4  post-attention norm; CTA c's router row (expert c, and
//       c + G, ... where experts outnumber SMs)                    -> logit  (LL8)
//       routing (every CTA, the same), the experts' gate-up rows,
//       SiLU * up                                                  -> act    (LL4)
//   P5  the experts' down rows, weighted sum                       -> xo     (LL4)
//
// What keeps the chain short (each measured, docs/gpu.md): a warp takes all rows of its stage in one pass
// (the rows share x's loads and their FMA chains overlap); the small vectors a phase needs after a wait
// (norm weights, the replica table) are loaded before it; routing picks each choice with one integer
// max-reduction over (logit, index) keys; the producer of an attention CTA prefetches the next layer's keys
// and values of its split into L2 (evict_last) while a layer routes, HBM being idle then, and the experts'
// rows stream with evict_first (small scattered KV reads otherwise wait long behind the weight streams).
//
// Compile-time constants (defines, from the host): H, NQ, NKV, D, NE (logical experts), TOPK, NI (expert
// intermediate size), BS (KV block size), NL (layers), QK_NORM, NORM_TOPK, STAGE_BYTES, SCR_BYTES,
// MAX_SPLITS, TIMING, and the switches: TPS, KV tiles per attention split (more splits where the SMs allow;
// 0: as many splits as the SMs allow); DYN (1, the default): the gate-up chunks are taken from a per-layer
// counter as each CTA's ring frees, so CTAs that stream faster take more (0: fixed slices). Inputs are
// bfloat16; accumulation is float32; rounding points are the reference ops' (see kernels/decode_megakernel.py).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef long long i64;

struct __align__(16) U4 { u32 x, y, z, w; };

#define NWARPS 8   // consumer warps
#define NC (32 * NWARPS)  // consumer threads
#define NT (NC + 32)  // and one producer warp
#define QKV_ROWS (NQ * D + 2 * NKV * D)
#define QDIM (NQ * D)
#define GRP (NQ / NKV)
#define HALF (D / 2)
#define RING 8  // stages; slot s is consumed by warp s wherever one warp takes a stage
#define KV_TILE 45
#define KV_ROW 272  // a key's 256 bytes padded to 272: 8 keys read together hit 8 distinct bank groups
#define KV_V_OFF (KV_TILE * KV_ROW)
#define MAX_DOWN_ROWS 32
#define WAIT_LIMIT (1LL << 24)  // polls (each an L2 round trip) before a wait gives up: seconds
#define MBAR_LIMIT (1LL << 22)

#ifndef TIMING
#define TIMING 0
#endif
#ifndef TPS
#define TPS 1
#endif
#ifndef DYN
#define DYN 1
#endif
#define STAMPS_PER_LAYER 32  // clock64 at [k], globaltimer at [STAMPS_PER_LAYER + k]
// The timing build's stage stamps: QKV stage i landed at [QKV_STAMP0 + i] (i < QKV_STAMPS), o-proj stage i at
// [OPJ_STAMP0 + i] (i < OPJ_STAMPS), after the 18 stamps of the layer's parts.
#define QKV_STAMP0 18
#define QKV_STAMPS 7
#define OPJ_STAMP0 25
#define OPJ_STAMPS 6
static_assert(QKV_STAMP0 + QKV_STAMPS <= OPJ_STAMP0 && OPJ_STAMP0 + OPJ_STAMPS <= STAMPS_PER_LAYER, "stamps");
#define ERR_LL 1u
#define ERR_MBAR 2u

struct LayerPtrs {
  const u16* in_norm;    // [H]
  const u16* qkv_w;      // [QKV_ROWS, H]
  const u16* q_norm;     // [D] (QK_NORM)
  const u16* k_norm;     // [D] (QK_NORM)
  const u16* o_w;        // [H, QDIM]
  const u16* post_norm;  // [H]
  const u16* w13;        // [physical experts, 2 NI, H]
  const u16* w2;         // [physical experts, H, NI]
  const i64* l2p;        // [NE, replicas]: physical id of each logical expert's replicas
  i64* counts;           // [physical experts]: tokens routed, for the EPLB controller
  const u16* gate_w;     // [NE, H]: the router's weight
};

struct Params {
  const LayerPtrs* layers;
  i64 l2p_stride;        // row stride of l2p
  const i64* token;      // [1]
  const i64* position;   // [1]
  const i64* slot;       // [1]: KV slot of the new token, -1: write nothing
  const int* seq_len;    // [1]: context length after this step, 0: a padding row
  const int* block_table;
  const u16* embed;      // [vocab, H]
  const float* cos_sin;  // [positions, D]: cos half, sin half
  u16* kv_pool;
  i64 pool_block, pool_layer, pool_kv, pool_slot, pool_head;  // element strides
  u16* x_out;            // [H]: the last layer's MLP output
  u16* res_out;          // [H]: the last layer's residual
  u32* ll_qkv;           // [QKV_ROWS]
  u32* ll_attn;          // [QDIM]
  u32* ll_h;             // [H]
  u32* ll_act;           // [TOPK * NI]
  u32* ll_xo;            // [H]
  U4* ll_part_o;         // [MAX_SPLITS][NQ][D / 2] pairs of LL8 words
  u64* ll_part_lse;      // [MAX_SPLITS][NQ] LL8 words
  u64* ll_logit;         // [NL][NE]: the router's logits (bf16 values) as LL8 words
  u32* gate_next;        // [NL]: DYN's next gate-up chunk of each layer (0 between launches)
  u32* epoch;
  u32* exit_count;
  u32* error;
  u64* timing;           // [G][NL][2 STAMPS_PER_LAYER]: clock64, then globaltimer (TIMING builds)
  float scale_log2;
  float eps;
};

// ---- numerics --------------------------------------------------------------------------------------
__device__ __forceinline__ float bf2f(u32 b) { return __uint_as_float((b & 0xffffu) << 16); }
__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 f2bf(float f) {  // round to nearest even, as torch
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rsq(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// A barrier of the consumer warps only (the producer warp never waits on them).
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"n"(NC) : "memory"); }
// The sum of v over the consumer threads, in each of them (red: NWARPS floats of scratch).
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  csync();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) t += red[w];
  csync();
  return t;
}
// 8 bf16 of a against 8 bf16 of b (16-byte vectors), accumulated into acc.
__device__ __forceinline__ float dot8(U4 a, U4 b, float acc) {
  acc = fmaf(bf_lo(a.x), bf_lo(b.x), acc);
  acc = fmaf(bf_hi(a.x), bf_hi(b.x), acc);
  acc = fmaf(bf_lo(a.y), bf_lo(b.y), acc);
  acc = fmaf(bf_hi(a.y), bf_hi(b.y), acc);
  acc = fmaf(bf_lo(a.z), bf_lo(b.z), acc);
  acc = fmaf(bf_hi(a.z), bf_hi(b.z), acc);
  acc = fmaf(bf_lo(a.w), bf_lo(b.w), acc);
  acc = fmaf(bf_hi(a.w), bf_hi(b.w), acc);
  return acc;
}

// ---- memory primitives -------------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{\n .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;\n}" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try(u32 bar, u32 parity) {
  u32 ok;
  asm volatile(
      "{\n .reg .pred P;\n mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n selp.u32 %0, 1, 0, P;\n}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ u32 ld_relaxed(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Whether a wait that has polled n times gives up: past its limit (recording `what` in err), or once
// any other wait has (so a broken launch ends in seconds, not one timeout per wait).
__device__ __forceinline__ bool give_up(i64 n, u32* err, i64 limit, u32 what) {
  if (n > limit) {
    atomicOr(err, what);
    return true;
  }
  if ((n & 4095) == 4095) return ld_relaxed(err) != 0;
  return false;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity, u32* err) {
  for (i64 n = 0; !mbar_try(bar, parity); ++n)
    if (give_up(n, err, MBAR_LIMIT, ERR_MBAR)) return;
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global to shared, completing on bar.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ U4 ld_relaxed4(const void* p) {
  U4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void ld_relaxed2(const u32* p, u32& a, u32& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ u64 ld_relaxed64(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed4(void* p, U4 v) {
  asm volatile("st.relaxed.gpu.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_relaxed64(u64* p, u64 v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// ---- LL words ------------------------------------------------------------------------------------------
// Every read below issues all its loads first and only then checks flags, so a batch of words costs one
// round trip to L2, not one per word; words whose flag is not current yet are loaded again.
__device__ __forceinline__ u32 ll4(u32 bf, u32 flag) { return (flag << 16) | (bf & 0xffffu); }
__device__ __forceinline__ void ll4_put(u32* p, float v, u32 flag) { st_relaxed(p, ll4(f2bf(v), flag)); }
__device__ __forceinline__ bool ll4_ok(U4 v, u32 flag) {
  return ((v.x >> 16) == flag) & ((v.y >> 16) == flag) & ((v.z >> 16) == flag) & ((v.w >> 16) == flag);
}
// N groups of four LL4 words, group i at base + i * stride (words; 16-byte aligned).
template <int N>
__device__ __forceinline__ void ll4_read(U4 (&v)[N], const u32* base, int stride, u32 flag, u32* err) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = ld_relaxed4(base + i * stride);
  for (i64 n = 0;; ++n) {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (!ll4_ok(v[i], flag)) {
        ok = false;
        v[i] = ld_relaxed4(base + i * stride);
      }
    }
    if (ok || give_up(n, err, WAIT_LIMIT, ERR_LL)) return;
  }
}
// N pairs of LL4 words (8-byte aligned), pair i at ptr[i]; out[2 i], out[2 i + 1] their values.
template <int N>
__device__ __forceinline__ void ll4_read_pairs(float (&out)[2 * N], const u32* const (&ptr)[N], u32 flag, u32* err) {
  u32 a[N], b[N];
#pragma unroll
  for (int i = 0; i < N; ++i) ld_relaxed2(ptr[i], a[i], b[i]);
  for (i64 n = 0;; ++n) {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (((a[i] >> 16) != flag) | ((b[i] >> 16) != flag)) {
        ok = false;
        ld_relaxed2(ptr[i], a[i], b[i]);
      }
    }
    if (ok || give_up(n, err, WAIT_LIMIT, ERR_LL)) break;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[2 * i] = bf2f(a[i]);
    out[2 * i + 1] = bf2f(b[i]);
  }
}
__device__ __forceinline__ u64 ll8(float v, u32 flag) { return ((u64)flag << 32) | __float_as_uint(v); }
// N LL8 words, word i at base + i * stride (words); missing ones (i >= n) read as 0.
template <int N>
__device__ __forceinline__ void ll8_read(float (&out)[N], const u64* base, i64 stride, int n, u32 flag, u32* err) {
  u64 v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = i < n ? ld_relaxed64(base + i * stride) : ((u64)flag << 32);
  for (i64 k = 0;; ++k) {
    bool ok = true;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if ((u32)(v[i] >> 32) != flag) {
        ok = false;
        v[i] = ld_relaxed64(base + i * stride);
      }
    }
    if (ok || give_up(k, err, WAIT_LIMIT, ERR_LL)) break;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = __uint_as_float((u32)v[i]);
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int part_lo(int n, int parts, int i) { return (int)((i64)n * i / parts); }

// ---- the ring of weight stages -------------------------------------------------------------------------
// One FIFO of RING stages carries every stream a layer reads, in the order the layer consumes it: its QKV
// rows, its KV tiles, its o-proj rows, its router columns, its experts' gate-up rows, their down rows; then
// the next layer's. A producer warp issues each item as soon as its stage is free (and, for the experts,
// once this CTA has routed the layer), so it runs ahead across phases and layers: the next layer's QKV rows
// stream while this layer's down rows are used, the o-proj rows while the attention runs. Item g sits in
// slot g % RING; a stage one warp consumes is consumed by warp g % RING (RING == NWARPS), so a warp only
// ever waits on a slot whose previous phase it saw complete; before a stage all warps consume, they meet.
// Each slot has a "full" barrier (the producer's expected bytes) and an "empty" one (one arrival).
__device__ __forceinline__ u32 full_bar(u32 bars, u32 g) { return bars + (g % RING) * 8; }
__device__ __forceinline__ u32 empty_bar(u32 bars, u32 g) { return bars + (RING + g % RING) * 8; }
__device__ __forceinline__ void wait_full(u32 bars, u32 g, u32* err) { mbar_wait(full_bar(bars, g), (g / RING) & 1u, err); }

// Shared memory: RING | XN (bf16 [H]) | HS (bf16 [H]) | SCR | MISC | barriers.
#define OFF_XN (RING * STAGE_BYTES)
#define OFF_HS (OFF_XN + 2 * H)
#define OFF_SCR (OFF_HS + 2 * H)
#define OFF_MISC (OFF_SCR + SCR_BYTES)
#define MISC_BYTES 4096
#define OFF_BARS (OFF_MISC + MISC_BYTES)
// The misc area's floats (decode_layers' misc pointers): gsum [0, 8), route_w [8, 24), route_id [24, 40),
// merge_w [40, 40 + MAX_SPLITS + 1), routed at 120, stage_meta [128, 128 + RING), down_acc from 512 on.
static_assert(40 + MAX_SPLITS + 1 <= 120 && 128 + RING <= 512 && 512 + 16 * MAX_DOWN_ROWS <= MISC_BYTES / 4,
              "the misc area's parts overlap or overflow");
#define SMEM_BYTES (OFF_BARS + 16 * RING)
// Items of four values a consumer thread handles in a vector of n values (n a multiple of 4 * NC).
#define ITEMS(n) ((n) / (4 * NC))
#define MIN_(a, b) ((a) < (b) ? (a) : (b))
#define QKV_CH MIN_(STAGE_BYTES / (2 * H), 16)      // QKV rows a stage holds
#define OPJ_CH MIN_(STAGE_BYTES / (2 * QDIM), 16)   // o-proj rows
#define GU_CH MIN_(STAGE_BYTES / (4 * H), 8)        // gate-up units (a gate row and its up row)
#define DOWN_CH MIN_(STAGE_BYTES / (2 * NI), MAX_DOWN_ROWS)  // down rows of one expert
#define PRE_TILES 4
#define CPE ((NI + GU_CH - 1) / GU_CH)  // DYN: gate-up chunks of an expert
#define NCHUNK (TOPK * CPE)              // DYN: gate-up chunks of a layer
#define SENTINEL 0x80000000u             // DYN: a stage that ends the gate-up items (| their number)

__device__ __forceinline__ void unpack4(u32 lo, u32 hi, float (&v)[4]) {
  v[0] = bf_lo(lo); v[1] = bf_hi(lo); v[2] = bf_lo(hi); v[3] = bf_hi(hi);
}
__device__ __forceinline__ void ll4_pack(U4 a, u32& lo, u32& hi) {
  lo = (a.x & 0xffffu) | (a.y << 16);
  hi = (a.z & 0xffffu) | (a.w << 16);
}
// rms-normalised s times the norm weight g, rounded as the reference: bf16(g * bf16(s * inv)).
__device__ __forceinline__ u32 norm2(u32 g, u32 s, float inv) {
  return f2bf(bf_lo(g) * rbf(bf_lo(s) * inv)) | (f2bf(bf_hi(g) * rbf(bf_hi(s) * inv)) << 16);
}
// The N bf16 of an LL4 vector into shared memory as they arrive (each consumer thread its items).
template <int N>
__device__ __forceinline__ void ll4_to_smem(u16* dst, const u32* src, u32 flag, u32* err, int tid) {
  U4 a[ITEMS(N)];
  ll4_read(a, src + tid * 4, NC * 4, flag, err);
#pragma unroll
  for (int t = 0; t < ITEMS(N); ++t) {
    u32* o = (u32*)(dst + (t * NC + tid) * 4);
    ll4_pack(a[t], o[0], o[1]);
  }
}
// The dot of a row of `len` bf16 with x (both in shared memory), summed over the warp (every lane).
__device__ __forceinline__ float row_dot(const u16* row, const u16* x, int len, int lane) {
  float acc = 0.f;
#pragma unroll 4
  for (int col = lane * 8; col < len; col += 256) acc = dot8(*(const U4*)(row + col), *(const U4*)(x + col), acc);
  return warp_sum(acc);
}
// The dots of NR rows (row r at rows + r * stride) with x, LEN bf16 each, all in shared memory; out[r] the
// warp's sum, in every lane. Each row keeps its own accumulator in row_dot's order (the same bits); the rows
// share each step's load of x, and their FMA chains run side by side instead of one after another.
template <int NR, int LEN>
__device__ __forceinline__ void rows_dot(float (&out)[NR], const u16* rows, int stride, const u16* x, int lane) {
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
#pragma unroll(NR > 8 ? 1 : 2)
  for (int col = lane * 8; col < LEN; col += 256) {
    const U4 xv = *(const U4*)(x + col);
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r] = dot8(*(const U4*)(rows + r * stride + col), xv, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}
// The norm weights a consumer thread's items of a vector of H need (norm_rows_w's g), loaded ahead of use.
struct NormW {
  u32 w[ITEMS(H)][2];
};
__device__ __forceinline__ NormW load_norm_w(const u16* g, int tid) {
  NormW n;
#pragma unroll
  for (int t = 0; t < ITEMS(H); ++t) {
    const u32* gv = (const u32*)(g + (t * NC + tid) * 4);
    n.w[t][0] = gv[0];
    n.w[t][1] = gv[1];
  }
  return n;
}
// xn = bf16(g * bf16(hs * inv)) over the consumer threads' items of a vector of H (the reference's norm),
// with the weights already in registers.
__device__ __forceinline__ void norm_rows_w(u16* xn, const u16* hs, const NormW& g, float inv, int tid) {
#pragma unroll
  for (int t = 0; t < ITEMS(H); ++t) {
    const int col = (t * NC + tid) * 4;
    const u32* sv = (const u32*)(hs + col);
    u32* o = (u32*)(xn + col);
    o[0] = norm2(g.w[t][0], sv[0], inv);
    o[1] = norm2(g.w[t][1], sv[1], inv);
  }
}
// L2 cache policies: rows read once (the experts) leave L2 first; prefetched KV rows stay longest.
__device__ __forceinline__ u64 policy_evict_first() {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ u64 policy_evict_last() {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// bulk_load with an L2 cache policy.
__device__ __forceinline__ void bulk_load_hint(u32 dst, const void* src, u32 bytes, u32 bar, u64 pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
}
// bytes (a multiple of 16, 16-byte aligned) from global memory into L2 only, with a cache policy;
// nothing waits for them.
__device__ __forceinline__ void prefetch_l2_hint(const void* src, u32 bytes, u64 pol) {
  asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src), "r"(bytes), "l"(pol)
               : "memory");
}

// With TIMING: a stamp of the SM clock and the global timer at part k of a layer, by the thread `who`.
#define STAMP_BY(who, k)                                             \
  do {                                                               \
    if (TIMING && (who)) {                                           \
      u64 t_, g_;                                                    \
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t_)::"memory");    \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_)::"memory"); \
      u64* s_ = p.timing + ((i64)c * NL + L) * 2 * STAMPS_PER_LAYER;  \
      s_[k] = t_;                                                    \
      s_[STAMPS_PER_LAYER + (k)] = g_;                               \
    }                                                                \
  } while (0)
// Consumer thread 0 of each CTA, at the end of each part of a layer.
#define STAMP(k) STAMP_BY(tid == 0, k)
// Lane 0 of the warp that takes a stage, once it has landed (the QKV and o-proj stages).
#define WSTAMP(k) STAMP_BY(lane == 0, k)

extern "C" __global__ void __launch_bounds__(NT, 1) decode_layers(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int G = gridDim.x, c = blockIdx.x;

  unsigned char* ring_mem = smem;
  u16* xn = (u16*)(smem + OFF_XN);
  u16* hs = (u16*)(smem + OFF_HS);
  unsigned char* scr = smem + OFF_SCR;
  float* misc = (float*)(smem + OFF_MISC);
  float* gsum = misc;                   // [NWARPS]
  float* route_w = misc + 8;            // [TOPK <= 16]
  int* route_id = (int*)(misc + 24);    // [TOPK <= 16]: physical ids
  float* merge_w = misc + 40;           // [MAX_SPLITS + 1]
  volatile int* routed = (volatile int*)(misc + 120);  // the last layer this CTA has routed
  float* down_acc = misc + 512;         // [TOPK][MAX_DOWN_ROWS]: each choice's weighted down rows
  volatile u32* stage_meta = (volatile u32*)(misc + 128);  // [RING]: DYN's chunks
  const u32 bars = smem_addr(smem + OFF_BARS);

  if (tid == 0) {
    for (int j = 0; j < 2 * RING; ++j) mbar_init(bars + 8 * j, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    *routed = -1;
  }
  __syncthreads();  // the last barrier of all NT threads

  u32* err = p.error;
  const u32 epoch = *(volatile u32*)p.epoch;
  const int seq_len = *p.seq_len;
  const i64 pos = *p.position;
  const i64 new_slot = *p.slot;
  const i64 token = *p.token;

  // This step's attention split, the same in every CTA: S splits of split_len keys per KV head.
  // TPS tiles a split where the SMs allow; TPS 0: as many splits as the SMs allow (fewer keys a CTA)
  int S = TPS > 0 ? (seq_len + TPS * KV_TILE - 1) / (TPS * KV_TILE) : seq_len;
  S = imax(1, imin(S, imin(MAX_SPLITS, G / NKV)));
  const int split_len = (seq_len + S - 1) / S;
  // This CTA's slices, fixed for the launch.
  const int q0 = part_lo(QKV_ROWS, G, c), nq = part_lo(QKV_ROWS, G, c + 1) - q0;
  const int o0 = part_lo(H, G, c), o1 = part_lo(H, G, c + 1), no = o1 - o0;  // o-proj, router, down rows
  const int u0 = part_lo(TOPK * NI, G, c), u1 = part_lo(TOPK * NI, G, c + 1);  // gate-up units
  const int n_qkv = (nq + QKV_CH - 1) / QKV_CH, n_opj = (no + OPJ_CH - 1) / OPJ_CH;
  const int pieces = (no + DOWN_CH - 1) / DOWN_CH;
  const int n_down = TOPK * pieces;
  // Gate-up chunks: up to GU_CH units of one expert, from u0 on.
  auto gu_chunks = [&]() {
    int n = 0;
    for (int u = u0; u < u1; ++n) u = imin(imin(u + GU_CH, u1), (u / NI + 1) * NI);
    return n;
  };
  const int n_gate = gu_chunks();
  const int n_rr = c < NE ? (NE - 1 - c) / G + 1 : 0;  // this CTA's router rows: c, c + G, ...

  const bool attn_cta = c < NKV * S;
  const int kvh = attn_cta ? c / S : 0, sp = attn_cta ? c % S : 0;
  const int k0 = attn_cta ? imin(seq_len, sp * split_len) : 0;
  const int k1 = attn_cta ? imin(seq_len, k0 + split_len) : 0;
  const bool own = attn_cta && k0 <= seq_len - 1 && seq_len - 1 < k1;  // holds the new token
  const int old_end = own ? seq_len - 1 : k1;  // keys read from the pool: [k0, old_end)
  const int n_tiles = (imax(0, old_end - k0) + KV_TILE - 1) / KV_TILE;

  // The ring's items, layer by layer: n_qkv | n_tiles | n_opj | 1 (router columns) | n_gate | n_down.
  const int first_expert = n_qkv + n_tiles + n_opj + 1;
  const int per_layer = first_expert + n_gate + n_down;

  if (warp == NWARPS) {
    // ================= the producer warp =================
    i64 tile_page[PRE_TILES];  // the pool pages of the first tiles' keys (lane j: key j), every layer's
#pragma unroll
    for (int t = 0; t < PRE_TILES; ++t) {
      const int kpos = k0 + t * KV_TILE + lane;
      tile_page[t] = (lane < KV_TILE && kpos < old_end) ? (i64)p.block_table[kpos / BS] : 0;
    }
    u32 g = 0;
    const u64 pol_first = policy_evict_first(), pol_last = policy_evict_last();
    for (int L = 0; L < NL; ++L) {
      const LayerPtrs q = p.layers[L];
      int gu = u0;  // the next gate-up unit
      for (int i = 0; i < per_layer; ++i, ++g) {
        if (i == first_expert) {  // the experts: once this CTA has routed the layer
          if (L + 1 < NL) {  // this split's old keys and values of the next layer, each row into L2
            const u16* base = p.kv_pool + (i64)(L + 1) * p.pool_layer + (i64)kvh * p.pool_head;
            for (int kpos = k0 + lane; kpos < old_end; kpos += 32) {
              const u16* src = base + (i64)p.block_table[kpos / BS] * p.pool_block + (i64)(kpos % BS) * p.pool_slot;
              prefetch_l2_hint(src, D * 2, pol_last);
              prefetch_l2_hint(src + p.pool_kv, D * 2, pol_last);
            }
          }
          for (i64 n = 0; *routed < L; ++n) {
            __nanosleep(64);
            if (give_up(n, err, WAIT_LIMIT, ERR_LL)) break;
          }
          __threadfence_block();
        }
#if DYN
        if (i == first_expert) {
          // The gate-up chunks: each taken from the layer's counter as a stage frees, so CTAs that stream
          // faster take more; then RING sentinels (one a slot, so every warp sees one) carry their number.
          u32 gn = g;
          if (lane == 0) {
            u32 n = 0, next = atomicAdd(p.gate_next + L, 1u);
            for (int it = 0; it < NCHUNK + RING; ++it, ++gn) {
              const u32 cur = next;
              const bool sentinel = cur >= (u32)NCHUNK;
              if (!sentinel) next = atomicAdd(p.gate_next + L, 1u);  // its answer is needed a stage later
              if (gn >= RING) mbar_wait(empty_bar(bars, gn), ((gn / RING) - 1) & 1u, err);
              const u32 stage = smem_addr(ring_mem) + (gn % RING) * STAGE_BYTES, bar = full_bar(bars, gn);
              if (sentinel) {
                stage_meta[gn % RING] = SENTINEL | n;
                mbar_arrive(bar);
                if (it >= (int)n + RING - 1) break;
                continue;
              }
              fence_async_smem();
              const int e = cur / CPE, j = (cur % CPE) * GU_CH, m = imin(GU_CH, NI - j);
              const u16* w = q.w13 + (i64)route_id[e] * (2 * NI) * H;
              stage_meta[gn % RING] = cur;
              mbar_expect(bar, m * 2 * H * 2);
              bulk_load_hint(stage, w + (i64)j * H, m * H * 2, bar, pol_first);
              bulk_load_hint(stage + GU_CH * H * 2, w + (i64)(NI + j) * H, m * H * 2, bar, pol_first);
              ++n;
            }
            ++gn;
          }
          // The loop goes on with the down items, which follow the static count of gate-up items (n_gate >= 1:
          // the plan has at least as many gate-up units as SMs).
          g = __shfl_sync(0xffffffffu, gn, 0) - 1;
          i = first_expert + n_gate - 1;
          continue;
        }
#endif
        if (g >= RING) mbar_wait(empty_bar(bars, g), ((g / RING) - 1) & 1u, err);
        const u32 stage = smem_addr(ring_mem) + (g % RING) * STAGE_BYTES, bar = full_bar(bars, g);
        if (lane == 0) fence_async_smem();
        if (i >= n_qkv && i < n_qkv + n_tiles) {
          const int t = i - n_qkv, first = k0 + t * KV_TILE, n = imin(KV_TILE, old_end - first);
          if (lane == 0) mbar_expect(bar, (u32)n * 2 * D * 2);
          __syncwarp();
          for (int j = lane; j < n; j += 32) {
            const int kpos = first + j;
            i64 page = 0;
            if (j == lane && t < PRE_TILES) {
#pragma unroll
              for (int u = 0; u < PRE_TILES; ++u)
                if (t == u) page = tile_page[u];
            } else {
              page = (i64)p.block_table[kpos / BS];
            }
            const u16* src = p.kv_pool + (i64)L * p.pool_layer + (i64)kvh * p.pool_head + page * p.pool_block +
                             (i64)(kpos % BS) * p.pool_slot;
            bulk_load(stage + j * KV_ROW, src, D * 2, bar);
            bulk_load(stage + KV_V_OFF + j * KV_ROW, src + p.pool_kv, D * 2, bar);
          }
          continue;
        }
        if (lane == 0) {
          const int x = i - first_expert;  // the expert phase's item, where i >= first_expert
          if (x < 0) {
            int k = i;
            if (k < n_qkv) {
              const int lo = k * QKV_CH, bytes = imin(QKV_CH, nq - lo) * H * 2;
              mbar_expect(bar, bytes);
              bulk_load(stage, q.qkv_w + (i64)(q0 + lo) * H, bytes, bar);
            } else if ((k -= n_qkv + n_tiles) < n_opj) {
              const int lo = k * OPJ_CH, bytes = imin(OPJ_CH, no - lo) * QDIM * 2;
              mbar_expect(bar, bytes);
              bulk_load(stage, q.o_w + (i64)(o0 + lo) * QDIM, bytes, bar);
            } else {  // the router item
              mbar_expect(bar, n_rr * H * 2);  // none: the stage completes on this arrival
              for (int r = 0; r < n_rr; ++r)
                bulk_load(stage + r * H * 2, q.gate_w + (i64)(c + r * G) * H, H * 2, bar);
            }
          } else {
            if (x < n_gate) {  // units [gu, end) of one expert: their gate rows, then their up rows
              const int e = gu / NI, j = gu % NI, end = imin(imin(gu + GU_CH, u1), (e + 1) * NI), n = end - gu;
              const u16* w = q.w13 + (i64)route_id[e] * (2 * NI) * H;
              mbar_expect(bar, n * 2 * H * 2);
              bulk_load_hint(stage, w + (i64)j * H, n * H * 2, bar, pol_first);
              bulk_load_hint(stage + GU_CH * H * 2, w + (i64)(NI + j) * H, n * H * 2, bar, pol_first);
              gu = end;
            } else {  // up to DOWN_CH of this CTA's output rows of one expert
              const int m2 = x - n_gate, e = m2 / pieces, r0 = (m2 % pieces) * DOWN_CH;
              const int bytes = imin(DOWN_CH, no - r0) * NI * 2;
              mbar_expect(bar, bytes);
              const u16* src = q.w2 + (i64)route_id[e] * H * NI + (i64)(o0 + r0) * NI;
              bulk_load_hint(stage, src, bytes, bar, pol_first);
            }
          }
        }
        __syncwarp();
      }
    }
    return;
  }

  // ================= the consumer warps =================
  u32 gb = 0;  // the ring index of the phase's first item
  u32 g_router = 0;  // the ring index of this layer's router item
  // A stage one warp consumes: item g, by warp g % RING; released by that warp.
  auto mine = [&](u32 g) { return (int)(g % RING) == warp; };
  auto release_warp = [&](u32 g) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar(bars, g));
  };
  auto stage_of = [&](u32 g) { return ring_mem + (g % RING) * STAGE_BYTES; };

  for (int L = 0; L < NL; ++L) {
    const LayerPtrs lp = p.layers[L];
    const u32 f16 = (epoch * (NL + 1) + L + 1) & 0xffffu;
    const u32 f32 = epoch * (NL + 1) + L + 1;
    const u32 f16_prev = (epoch * (NL + 1) + L) & 0xffffu;
    STAMP(0);

    // ---------------- P1: the residual add, the input norm, this CTA's QKV rows ----------------
    {
      constexpr int NI4 = ITEMS(H);
      float v[NI4][4];
      float ss = 0.f;
      const NormW g_in = load_norm_w(lp.in_norm, tid);
      if (L == 0) {
#pragma unroll
        for (int t = 0; t < NI4; ++t) {
          const u32* x = (const u32*)(p.embed + token * H + (t * NC + tid) * 4);
          unpack4(x[0], x[1], v[t]);
        }
      } else {
        U4 a[NI4];
        ll4_read(a, p.ll_xo + tid * 4, NC * 4, f16_prev, err);
        STAMP(1);
#pragma unroll
        for (int t = 0; t < NI4; ++t) {
          const u32* r = (const u32*)(hs + (t * NC + tid) * 4);  // the residual: the previous layer's h
          float rv[4];
          unpack4(r[0], r[1], rv);
          v[t][0] = rbf(bf2f(a[t].x) + rv[0]);
          v[t][1] = rbf(bf2f(a[t].y) + rv[1]);
          v[t][2] = rbf(bf2f(a[t].z) + rv[2]);
          v[t][3] = rbf(bf2f(a[t].w) + rv[3]);
        }
      }
#pragma unroll
      for (int t = 0; t < NI4; ++t) {
        u32* o = (u32*)(hs + (t * NC + tid) * 4);  // x + residual: this layer's residual stream (P3 reads it)
        o[0] = f2bf(v[t][0]) | (f2bf(v[t][1]) << 16);
        o[1] = f2bf(v[t][2]) | (f2bf(v[t][3]) << 16);
#pragma unroll
        for (int k = 0; k < 4; ++k) ss += v[t][k] * v[t][k];
      }
      const float inv = rsq(block_sum(ss, gsum) / H + p.eps);
      norm_rows_w(xn, hs, g_in, inv, tid);
      csync();
      for (int i = 0; i < n_qkv; ++i) {
        const u32 g = gb + i;
        if (!mine(g)) continue;
        wait_full(bars, g, err);
        if (i < QKV_STAMPS) WSTAMP(QKV_STAMP0 + i);
        const u16* st = (const u16*)stage_of(g);
        const int n = imin(QKV_CH, nq - i * QKV_CH);
        float acc[QKV_CH];  // rows past n are stale stage bytes: computed, never used
        rows_dot<QKV_CH, H>(acc, st, H, xn, lane);
#pragma unroll
        for (int r = 0; r < QKV_CH; ++r)
          if (r < n && lane == r) ll4_put(p.ll_qkv + q0 + i * QKV_CH + r, acc[r], f16);
        release_warp(g);
      }
      gb += n_qkv;
      STAMP(2);
    }

    // ---------------- P2: attention of one KV head's q heads over one split of the keys ----------------
    if (attn_cta) {
      u16* qs = (u16*)scr;                      // [GRP][D]: rotated q, bf16
      float* sc = (float*)(scr + GRP * D * 2);  // [NWARPS][64]: scores, then probabilities
      const int w = warp;
      const bool head_warp = w < GRP;
      const int head = kvh * GRP + w;
      // A lane's dims, as rotate-half pairs them: d, d + 1 and HALF + d, HALF + d + 1 (d = 2 lane).
      const int d = 2 * lane;
      const float* cs = p.cos_sin + pos * D;
      const float c0 = cs[d], c1 = cs[d + 1], s0 = cs[HALF + d], s1 = cs[HALF + d + 1];
      float x[12];  // q | k | v at this lane's dims
      float qnw[4] = {1.f, 1.f, 1.f, 1.f}, knw[4] = {1.f, 1.f, 1.f, 1.f};  // the q and k norms' weights
      if (QK_NORM) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int dim = (k & 2 ? HALF : 0) + d + (k & 1);
          qnw[k] = bf2f(lp.q_norm[dim]);
          knw[k] = bf2f(lp.k_norm[dim]);
        }
      }
      {
        const u32* qkv = p.ll_qkv;
        const int qrow = head_warp ? head * D : kvh * GRP * D;
        if (own) {
          const u32* const ptr[6] = {qkv + qrow + d, qkv + qrow + HALF + d,
                                     qkv + QDIM + kvh * D + d, qkv + QDIM + kvh * D + HALF + d,
                                     qkv + QDIM + NKV * D + kvh * D + d, qkv + QDIM + NKV * D + kvh * D + HALF + d};
          ll4_read_pairs<6>(x, ptr, f16, err);
        } else {
          const u32* const ptr[2] = {qkv + qrow + d, qkv + qrow + HALF + d};
          float y[4];
          ll4_read_pairs<2>(y, ptr, f16, err);
#pragma unroll
          for (int k = 0; k < 4; ++k) x[k] = y[k];
        }
      }
      STAMP(13);
      auto norm_rope = [&](float* y, const float (&nw)[4]) {
        if (QK_NORM) {
          const float inv = rsq(warp_sum(y[0] * y[0] + y[1] * y[1] + y[2] * y[2] + y[3] * y[3]) / D + p.eps);
#pragma unroll
          for (int k = 0; k < 4; ++k) y[k] = rbf(nw[k] * rbf(y[k] * inv));
        }
        const float a0 = y[0], a1 = y[1], b0 = y[2], b1 = y[3];
        y[0] = rbf(a0 * c0 - b0 * s0);
        y[1] = rbf(a1 * c1 - b1 * s1);
        y[2] = rbf(b0 * c0 + a0 * s0);
        y[3] = rbf(b1 * c1 + a1 * s1);
      };
      norm_rope(x, qnw);
      if (head_warp) {
        qs[w * D + d] = (u16)f2bf(x[0]);
        qs[w * D + d + 1] = (u16)f2bf(x[1]);
        qs[w * D + HALF + d] = (u16)f2bf(x[2]);
        qs[w * D + HALF + d + 1] = (u16)f2bf(x[3]);
      }
      if (own) {
        norm_rope(x + 4, knw);
        if (w == 0 && new_slot >= 0) {  // the new token's k and v into the pool, for later steps
          u16* dst = p.kv_pool + (new_slot / BS) * p.pool_block + (i64)L * p.pool_layer +
                     (new_slot % BS) * p.pool_slot + (i64)kvh * p.pool_head;
          *(u32*)(dst + d) = f2bf(x[4]) | (f2bf(x[5]) << 16);
          *(u32*)(dst + HALF + d) = f2bf(x[6]) | (f2bf(x[7]) << 16);
          *(u32*)(dst + p.pool_kv + d) = f2bf(x[8]) | (f2bf(x[9]) << 16);
          *(u32*)(dst + p.pool_kv + HALF + d) = f2bf(x[10]) | (f2bf(x[11]) << 16);
        }
      }
      csync();  // qs complete; every warp is past its own stages before all take the tiles
      STAMP(15);
      // Scores: 8 keys a step, lane 8 kq + kj takes quarter kq of key kj's dims (32 q values a lane).
      const int kq = lane >> 3, kj = lane & 7;
      float qq[D / 4];
#pragma unroll
      for (int t = 0; t < D / 4; ++t) qq[t] = head_warp ? bf2f(qs[w * D + kq * (D / 4) + t]) : 0.f;
      float m = NEG_INF, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int t = 0; t < n_tiles; ++t) {
        const u32 g = gb + t;
        const int n = imin(KV_TILE, old_end - (k0 + t * KV_TILE));
        wait_full(bars, g, err);
        if (t == 0) STAMP(16);
        const unsigned char* st = stage_of(g);
        if (head_warp) {
          for (int j0 = 0; j0 < n; j0 += 8) {
            const int j = j0 + kj;
            float s = 0.f;
            if (j < n) {
              const u16* krow = (const u16*)(st + j * KV_ROW) + kq * (D / 4);
              float part[D / 32];  // one chain per 8 dims, summed at the end: short FMA chains
#pragma unroll
              for (int t4 = 0; t4 < D / 4; t4 += 8) {
                const U4 kv = *(const U4*)(krow + t4);
                float a = qq[t4 + 0] * bf_lo(kv.x);
                a = fmaf(qq[t4 + 1], bf_hi(kv.x), a);
                a = fmaf(qq[t4 + 2], bf_lo(kv.y), a); a = fmaf(qq[t4 + 3], bf_hi(kv.y), a);
                a = fmaf(qq[t4 + 4], bf_lo(kv.z), a); a = fmaf(qq[t4 + 5], bf_hi(kv.z), a);
                a = fmaf(qq[t4 + 6], bf_lo(kv.w), a); a = fmaf(qq[t4 + 7], bf_hi(kv.w), a);
                part[t4 / 8] = a;
              }
              s = (part[0] + part[1]) + (part[2] + part[3]);
            }
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            if (kq == 0 && j < n) sc[w * 64 + j] = s * p.scale_log2;
          }
          __syncwarp();
          const float sa = lane < n ? sc[w * 64 + lane] : NEG_INF;
          const float sb = lane + 32 < n ? sc[w * 64 + lane + 32] : NEG_INF;
          const float m_new = fmaxf(m, warp_max(fmaxf(sa, sb)));
          const float alpha = ex2(m - m_new);  // m = -inf before the first keys: alpha = 0
          const float pa = lane < n ? ex2(sa - m_new) : 0.f, pb = lane + 32 < n ? ex2(sb - m_new) : 0.f;
          l = l * alpha + warp_sum(pa + pb);
          m = m_new;
          __syncwarp();
          sc[w * 64 + lane] = rbf(pa);  // the p.v product takes p in bf16
          sc[w * 64 + lane + 32] = rbf(pb);
          __syncwarp();
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[k] *= alpha;
#pragma unroll 8
          for (int j = 0; j < n; ++j) {
            const float pj = sc[w * 64 + j];
            const u16* vrow = (const u16*)(st + KV_V_OFF + j * KV_ROW);
            const u32 va = *(const u32*)(vrow + d), vb = *(const u32*)(vrow + HALF + d);
            acc[0] = fmaf(pj, bf_lo(va), acc[0]);
            acc[1] = fmaf(pj, bf_hi(va), acc[1]);
            acc[2] = fmaf(pj, bf_lo(vb), acc[2]);
            acc[3] = fmaf(pj, bf_hi(vb), acc[3]);
          }
        }
        csync();  // the tile is read
        if (tid == 0) mbar_arrive(empty_bar(bars, g));
      }
      STAMP(14);
      if (head_warp) {
        if (own) {  // the new token's key and value, from registers
          const float s = warp_sum(x[0] * x[4] + x[1] * x[5] + x[2] * x[6] + x[3] * x[7]) * p.scale_log2;
          const float m_new = fmaxf(m, s);
          const float alpha = ex2(m - m_new), pr = ex2(s - m_new);
          l = l * alpha + pr;
          m = m_new;
          const float pb = rbf(pr);
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[k] = acc[k] * alpha + pb * x[8 + k];
        }
        const bool any = l > 0.f;
        const float inv_l = any ? 1.f / l : 0.f;
        const float lse = any ? m + lg2(l) : NEG_INF;
        U4* po = p.ll_part_o + ((i64)sp * NQ + head) * (D / 2);
        U4 a, b;
        a.x = __float_as_uint(acc[0] * inv_l); a.y = f32; a.z = __float_as_uint(acc[1] * inv_l); a.w = f32;
        b.x = __float_as_uint(acc[2] * inv_l); b.y = f32; b.z = __float_as_uint(acc[3] * inv_l); b.w = f32;
        st_relaxed4(po + lane, a);             // dims d, d + 1: LL8 words d, d + 1
        st_relaxed4(po + HALF / 2 + lane, b);  // dims HALF + d, HALF + d + 1
        if (lane == 0) st_relaxed64(p.ll_part_lse + (i64)sp * NQ + head, ll8(lse, f32));
      }
    }
    gb += n_tiles;
    STAMP(3);

    // ---------------- P2b: merge the splits, one (q head, 32 dims) unit a CTA ----------------
    for (int u = c; u < NQ * (D / 32); u += G) {
      const int head = u / (D / 32), dim = (u % (D / 32)) * 32 + lane;
      float* part = (float*)scr;  // [NWARPS][32]
      constexpr int PER = (MAX_SPLITS + NWARPS - 1) / NWARPS;
      float o[PER];  // splits warp, warp + 8, ... of this dim, loaded at once with the lse below
      const u64* po = (const u64*)p.ll_part_o + ((i64)warp * NQ + head) * D + dim;
      ll8_read<PER>(o, po, (i64)NWARPS * NQ * D, (S - warp + NWARPS - 1) / NWARPS, f32, err);
      if (warp == 0) {
        constexpr int PL = (MAX_SPLITS + 31) / 32;
        float lse[PL];
        ll8_read<PL>(lse, p.ll_part_lse + (i64)lane * NQ + head, (i64)32 * NQ, (S - lane + 31) / 32, f32, err);
        float mx = NEG_INF;
#pragma unroll
        for (int k = 0; k < PL; ++k)
          if (k * 32 + lane < S) mx = fmaxf(mx, lse[k]);
        mx = warp_max(mx);
        float tot = 0.f;
#pragma unroll
        for (int k = 0; k < PL; ++k) {
          const int s = k * 32 + lane;
          if (s < S) {
            const float wgt = lse[k] == NEG_INF ? 0.f : ex2(lse[k] - mx);
            merge_w[s] = wgt;
            tot += wgt;
          }
        }
        tot = warp_sum(tot);
        if (lane == 0) merge_w[MAX_SPLITS] = tot;
      }
      csync();
      float a = 0.f;
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int s = warp + k * NWARPS;
        if (s < S) a += merge_w[s] * o[k];
      }
      part[warp * 32 + lane] = a;
      csync();
      if (warp == 0) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) t += part[w * 32 + lane];
        const float tot = merge_w[MAX_SPLITS];
        ll4_put(p.ll_attn + head * D + dim, tot > 0.f ? t / tot : 0.f, f16);
      }
      csync();
    }
    STAMP(4);

    // ---------------- P3: o-proj rows, the residual ----------------
    {
      u16* attn = (u16*)scr;  // [QDIM] bf16
      ll4_to_smem<QDIM>(attn, p.ll_attn, f16, err, tid);
      STAMP(5);
      csync();
      STAMP(17);
      for (int i = 0; i < n_opj; ++i) {
        const u32 g = gb + i;
        if (!mine(g)) continue;
        wait_full(bars, g, err);
        if (i < OPJ_STAMPS) WSTAMP(OPJ_STAMP0 + i);
        const u16* st = (const u16*)stage_of(g);
        const int n = imin(OPJ_CH, no - i * OPJ_CH);
        auto put_row = [&](int r, float acc) {
          const float h = rbf(rbf(acc) + bf2f(hs[o0 + r]));
          ll4_put(p.ll_h + o0 + r, h, f16);
          if (L == NL - 1) p.res_out[o0 + r] = (u16)f2bf(h);
        };
        float acc[OPJ_CH];
        rows_dot<OPJ_CH, QDIM>(acc, st, QDIM, attn, lane);
#pragma unroll
        for (int rr = 0; rr < OPJ_CH; ++rr)
          if (rr < n && lane == rr) put_row(i * OPJ_CH + rr, acc[rr]);
        release_warp(g);
      }
      gb += n_opj;
      csync();  // every warp is past its own stages
      g_router = gb;
      gb += 1;  // P4 reads the router rows, once h is normalised
      STAMP(6);
    }

    // ---------------- P4: the post-attention norm, routing, the experts' gate-up rows ----------------
    {
      constexpr int NI4 = ITEMS(H);
      constexpr int NLG = (NE + 31) / 32;
      const NormW g_post = load_norm_w(lp.post_norm, tid);
      int l2p_own[NLG];  // warp 0: replica 0's physical id of experts lane, 32 + lane, ...
      if (warp == 0) {
#pragma unroll
        for (int k = 0; k < NLG; ++k) {
          const int e = k * 32 + lane;
          l2p_own[k] = e < NE ? (int)lp.l2p[(i64)e * p.l2p_stride] : 0;
        }
      }
      U4 a[NI4];
      ll4_read(a, p.ll_h + tid * 4, NC * 4, f16, err);
      STAMP(7);
      float ss = 0.f;
#pragma unroll
      for (int t = 0; t < NI4; ++t) {
        u32* o = (u32*)(hs + (t * NC + tid) * 4);  // h: the next layer's residual
        ll4_pack(a[t], o[0], o[1]);
        const float v0 = bf2f(a[t].x), v1 = bf2f(a[t].y), v2 = bf2f(a[t].z), v3 = bf2f(a[t].w);
        ss += v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3;
      }
      const float inv = rsq(block_sum(ss, gsum) / H + p.eps);
      norm_rows_w(xn, hs, g_post, inv, tid);
      csync();  // xn complete
      if (warp == 0) {
        float lg[NLG];
        {  // this CTA's router rows against xn, rounded as the reference's bf16 logits, to every CTA
          wait_full(bars, g_router, err);
          const u16* rows = (const u16*)stage_of(g_router);
          u64* out = p.ll_logit + (i64)L * NE;
          for (int r = 0; r < n_rr; ++r) {
            const float logit = rbf(row_dot(rows + (size_t)r * H, xn, H, lane));
            if (lane == 0) st_relaxed64(out + c + r * G, ll8(logit, f32));
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(empty_bar(bars, g_router));
          STAMP(8);
          float got[NLG];
          ll8_read<NLG>(got, out + lane, 32, (NE - lane + 31) / 32, f32, err);
#pragma unroll
          for (int k = 0; k < NLG; ++k) lg[k] = k * 32 + lane < NE ? got[k] : NEG_INF;
        }
        float mx = NEG_INF;
#pragma unroll
        for (int k = 0; k < NLG; ++k) mx = fmaxf(mx, lg[k]);
        mx = warp_max(mx);
        float den = 0.f;
#pragma unroll
        for (int k = 0; k < NLG; ++k) den += lg[k] == NEG_INF ? 0.f : expf(lg[k] - mx);
        den = warp_sum(den);
        float my_w = 0.f, wsum = 0.f;
        int my_e = 0, my_phys = 0;
        // Keys: the logit's bf16 bits made orderable as unsigned (lg is bf16-exact; -0 taken as +0), then
        // 0xffff - e: the largest key is the largest logit and, among equal logits, the lowest expert.
        u32 key[NLG];
#pragma unroll
        for (int k = 0; k < NLG; ++k) {
          const int e = k * 32 + lane;
          u32 b = __float_as_uint(lg[k]) >> 16;
          b = b == 0x8000u ? 0u : b;
          const u32 o = (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
          key[k] = e < NE ? (o << 16) | (0xffffu - (u32)e) : 0u;
        }
#pragma unroll
        for (int t = 0; t < TOPK; ++t) {
          u32 best = 0u;
#pragma unroll
          for (int k = 0; k < NLG; ++k) best = max(best, key[k]);
          best = __reduce_max_sync(0xffffffffu, best);
#pragma unroll
          for (int k = 0; k < NLG; ++k)
            if (key[k] == best) key[k] = 0u;
          const int be = (int)(0xffffu - (best & 0xffffu));
          const u32 bo = best >> 16;
          const float bv = __uint_as_float(((bo & 0x8000u) ? (bo & 0x7fffu) : (~bo & 0xffffu)) << 16);
          const float wt = expf(bv - mx) / den;
          wsum += wt;
          if (lane == t) {
            my_w = wt;
            my_e = be;
          }
        }
        // lane t's choice's physical id, from the lane that preloaded it (every slot shuffled: a register
        // array indexed at run time would go to local memory)
#pragma unroll
        for (int k = 0; k < NLG; ++k) {
          const int v = __shfl_sync(0xffffffffu, l2p_own[k], my_e & 31);
          my_phys = k == (my_e >> 5) ? v : my_phys;
        }
        if (lane < TOPK) {  // lane t: the t-th choice; its physical id (replica 0: token 0 % replicas)
          route_w[lane] = rbf(NORM_TOPK ? my_w / wsum : my_w);
          const int phys = my_phys;
          route_id[lane] = phys;
          if (c == 0) atomicAdd((u64*)(lp.counts + phys), 1ull);
        }
        __syncwarp();
        if (lane == 0) {
          __threadfence_block();
          *routed = L;  // the producer may issue this layer's experts
        }
      }
      csync();  // route_w, route_id and xn complete
      STAMP(9);
      // the reference rounds gate and up, then SiLU, then the product
      auto gate_up = [&](const u16* st, int e, int j, int n) {  // n gate rows, then (at GU_CH rows) n up rows
        float acc[2 * GU_CH];  // gate rows | up rows
        rows_dot<2 * GU_CH, H>(acc, st, H, xn, lane);
#pragma unroll
        for (int r = 0; r < GU_CH; ++r)
          if (r < n && lane == r) {
            const float gate = rbf(acc[r]), up = rbf(acc[GU_CH + r]);
            const float silu = rbf(gate / (1.f + ex2(-gate * 1.4426950408889634f)));
            ll4_put(p.ll_act + e * NI + j + r, silu * up, f16);
          }
      };
#if DYN
      {  // this warp's stages up to its sentinel, which says how many chunks the producer issued
        u32 n_dyn = 0;
        u32 g = gb + (u32)((warp - (int)(gb % RING) + RING) % RING);
        for (int it = 0; it <= NCHUNK; ++it, g += RING) {
          wait_full(bars, g, err);
          const u32 meta = stage_meta[g % RING];
          if (meta & SENTINEL) {
            n_dyn = meta & ~SENTINEL;
            release_warp(g);
            break;
          }
          const int j = (int)(meta % CPE) * GU_CH;
          gate_up((const u16*)stage_of(g), (int)(meta / CPE), j, imin(GU_CH, NI - j));
          release_warp(g);
        }
        gb += n_dyn + RING;
      }
#else
      int gu = u0;
      for (int i = 0; i < n_gate; ++i) {
        const u32 g = gb + i;
        const int e = gu / NI, j = gu % NI, end = imin(imin(gu + GU_CH, u1), (e + 1) * NI), n = end - gu;
        gu = end;
        if (!mine(g)) continue;
        wait_full(bars, g, err);
        gate_up((const u16*)stage_of(g), e, j, n);
        release_warp(g);
      }
      gb += n_gate;
#endif
      STAMP(10);
    }

    // ---------------- P5: the experts' down rows, weighted and summed ----------------
    {
      u16* act = (u16*)scr;  // [TOPK * NI] bf16
      ll4_to_smem<TOPK * NI>(act, p.ll_act, f16, err, tid);
      STAMP(11);
      csync();
      for (int m2 = 0; m2 < n_down; ++m2) {
        const u32 g = gb + m2;
        if (!mine(g)) continue;
        const int k = m2 / pieces, r0 = (m2 % pieces) * DOWN_CH, rn = imin(DOWN_CH, no - r0);
        wait_full(bars, g, err);
        const u16* st = (const u16*)stage_of(g);
        const float wk = route_w[k];
        float acc[DOWN_CH];
        rows_dot<DOWN_CH, NI>(acc, st, NI, act + k * NI, lane);
#pragma unroll
        for (int r = 0; r < DOWN_CH; ++r)
          if (r < rn && lane == r) down_acc[k * MAX_DOWN_ROWS + r0 + r] = wk * acc[r];
        release_warp(g);
      }
      gb += n_down;
      csync();
      for (int r = tid; r < no; r += NC) {
        float xo = 0.f;
#pragma unroll
        for (int k = 0; k < TOPK; ++k) xo += down_acc[k * MAX_DOWN_ROWS + r];  // the choices in order
        ll4_put(p.ll_xo + o0 + r, xo, f16);
        if (L == NL - 1) p.x_out[o0 + r] = (u16)f2bf(xo);
      }
      csync();
      STAMP(12);
    }
  }

  // The last CTA to leave advances the epoch, so the next launch's flags are new.
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(p.exit_count, 1u) == (u32)G - 1) {
      *(volatile u32*)p.exit_count = 0;
      if (DYN)
        for (int l = 0; l < NL; ++l) *(volatile u32*)(p.gate_next + l) = 0;
      *(volatile u32*)p.epoch = epoch + 1;
      __threadfence();
    }
  }
}
