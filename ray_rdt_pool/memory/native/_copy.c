/*
 * Streaming-store copies for large host-memory copies: the optional compiled helper of
 * ray_rdt_pool.memory.fastcopy, a plain shared library (no Python, no torch) built by
 * `python -m ray_rdt_pool.memory.native build` and called through ctypes. Without it the
 * package copies with memmove, with the same results.
 *
 * Why: a large pack writes memory that is not in cache. Plain stores first read every
 * destination line into the cache (read for ownership) and only then overwrite it, so a
 * copy moves three bytes per byte copied. Streaming (non-temporal) stores write whole
 * lines without reading them. glibc's memmove uses them only above a threshold derived
 * from the cache size, far above the few-MiB units a threaded pack copies, so those
 * units pay for the extra reads.
 *
 * The copy reads four pages at a time, one 64-byte line from each in turn: several
 * independent read streams keep more of the memory system busy than one.
 *
 * It also holds the pack's other copy, rdt_quantize_fp8: a weight quantized into FP8
 * with block scales on its way into a bucket (see its comment below).
 *
 * Threads: every function runs on its caller's thread and touches no Python state;
 * ctypes releases the GIL around them, so the pack threads copy in parallel.
 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define RDT_X86 1
#endif

#define RDT_PAGE 4096u
#define RDT_LINE 64u
/* Moves shorter than this use memmove: for smaller moves the fence after each costs
 * about what streaming saves. */
#define RDT_MOVE_MIN (128u * 1024u)

/* 0: memmove only; 1: SSE2 streaming stores (every x86-64 CPU has them; wider stores
 * gain nothing, since the copy waits on memory, not on instructions). */
#ifdef RDT_X86
#define RDT_KIND 1
#else
#define RDT_KIND 0
#endif

#ifdef RDT_X86
/* Stream one 64-byte line: dst is 64-byte aligned, src need not be. */
static inline void rdt_line_sse2(unsigned char *dst, const unsigned char *src)
{
    const __m128i *p = (const __m128i *)src;
    __m128i *q = (__m128i *)dst;
    __m128i x0 = _mm_loadu_si128(p);
    __m128i x1 = _mm_loadu_si128(p + 1);
    __m128i x2 = _mm_loadu_si128(p + 2);
    __m128i x3 = _mm_loadu_si128(p + 3);
    _mm_stream_si128(q, x0);
    _mm_stream_si128(q + 1, x1);
    _mm_stream_si128(q + 2, x2);
    _mm_stream_si128(q + 3, x3);
}

/* Copy whole blocks of four pages; dst is 64-byte aligned, src need not be. */
static void rdt_blocks_sse2(unsigned char *dst, const unsigned char *src, size_t blocks)
{
    for (size_t b = 0; b < blocks; b++) {
        const unsigned char *s = src + b * 4 * RDT_PAGE;
        unsigned char *d = dst + b * 4 * RDT_PAGE;
        for (size_t i = 0; i < RDT_PAGE; i += RDT_LINE)
            for (unsigned k = 0; k < 4; k++)
                rdt_line_sse2(d + k * RDT_PAGE + i, s + k * RDT_PAGE + i);
    }
}

/* Stream whole 64-byte lines, one after the other (dst 64-byte aligned), with no fence:
 * the small moves of one batch share the fence at its end. */
static void rdt_lines_sse2(unsigned char *dst, const unsigned char *src, size_t lines)
{
    for (size_t i = 0; i < lines; i++)
        rdt_line_sse2(dst + i * RDT_LINE, src + i * RDT_LINE);
}

/* Copy n bytes: the head up to dst's next 64-byte boundary and the tail with memcpy, and
 * the whole units of `unit` bytes between them through `body` (streamed, no fence). */
static void rdt_stream_span(unsigned char *dst, const unsigned char *src, size_t n,
                            size_t unit,
                            void (*body)(unsigned char *, const unsigned char *, size_t))
{
    size_t head = (RDT_LINE - ((uintptr_t)dst & (RDT_LINE - 1))) & (RDT_LINE - 1);
    memcpy(dst, src, head);
    size_t units = (n - head) / unit;
    body(dst + head, src + head, units);
    size_t done = head + units * unit;
    memcpy(dst + done, src + done, n - done);
}
#endif

/* Copy n bytes from src to dst. Overlapping ranges, moves under RDT_MOVE_MIN and
 * machines without streaming stores go through memmove; the rest streams whole 16 KiB
 * blocks and copies the unaligned head and the tail with memcpy. Every streamed byte is
 * globally visible when this returns (sfence). */
void rdt_stream_copy(void *dst, const void *src, size_t n)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (RDT_KIND == 0 || n < RDT_MOVE_MIN || (d < s + n && s < d + n)) {
        memmove(dst, src, n);
        return;
    }
#ifdef RDT_X86
    rdt_stream_span((unsigned char *)dst, (const unsigned char *)src, n, 4 * RDT_PAGE,
                    rdt_blocks_sse2);
    _mm_sfence();
#endif
}

/* Moves of a streamed batch shorter than this use memmove: the unaligned head and tail
 * of a move are plain stores, so a move of a few lines gains nothing. */
#define RDT_SMALL_MIN 1024u

/* Copy count moves, given as (destination, source, bytes) triples of int64 in order.
 * One foreign call for a whole pack: an object of thousands of tensors of a few KiB
 * each (one RL sample field per tensor) would otherwise pay a ctypes call per tensor,
 * which costs as much as the copy itself.
 *
 * With stream non-zero (a pack large enough not to stay in cache), moves of at least
 * RDT_MOVE_MIN go through rdt_stream_copy, and moves of at least RDT_SMALL_MIN stream
 * their whole lines too, with one fence for all of them at the end: per-move fences
 * are what made streaming lose on small moves. Overlapping moves, smaller ones, and
 * everything when stream is 0, use memmove. Every byte is in place and globally
 * visible when this returns. */
void rdt_copy_moves(const int64_t *moves, size_t count, int stream)
{
#ifdef RDT_X86
    int fence = 0;
#endif
    for (size_t i = 0; i < count; i++) {
        void *dst = (void *)(uintptr_t)moves[3 * i];
        const void *src = (const void *)(uintptr_t)moves[3 * i + 1];
        size_t n = (size_t)moves[3 * i + 2];
        uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
        if (!stream || RDT_KIND == 0 || n < RDT_SMALL_MIN || (d < s + n && s < d + n)) {
            memmove(dst, src, n);
            continue;
        }
        if (n >= RDT_MOVE_MIN) {
            rdt_stream_copy(dst, src, n);
            continue;
        }
#ifdef RDT_X86
        rdt_stream_span((unsigned char *)dst, (const unsigned char *)src, n, RDT_LINE,
                        rdt_lines_sse2);
        fence = 1;
#endif
    }
#ifdef RDT_X86
    if (fence)
        _mm_sfence();
#endif
}

/* Which copy rdt_stream_copy uses: 0 memmove, 1 SSE2 streaming stores. */
int rdt_stream_kind(void)
{
    return RDT_KIND;
}

/* ---------------------------------------------------------------- FP8 quantizing copy
 *
 * Why here: torch's CPU quantizing of a bf16 weight into FP8 with block scales runs as
 * five passes over temporaries (to fp32, abs, amax, divide, cast) and costs about forty
 * bf16 copies; this does it in two reads of the source (amax, then quantize) and one
 * write of the FP8 bytes, with the same arithmetic, so the result is bit for bit
 * torch's (ray_rdt_pool.weights.fp8.quantize is the reference; a test compares them).
 */

static inline uint32_t rdt_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float rdt_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The constants of torch's fp32 -> FP8 (c10's fp8e4m3fn_from_fp32_value and
 * fp8e5m2_from_fp32_value): round to nearest even; for e4m3fn (3 mantissa bits, bias 7)
 * a finite overflow or inf saturates to 448 (0x7E), for e5m2 (2 bits, bias 15) it is
 * inf (0x7C); NaN is 0x7F. */
typedef struct {
    uint32_t shift;     /* 23 - mantissa bits */
    uint32_t rebias;    /* (bias - 127) << 23, modulo 2^32 */
    uint32_t round;     /* half an FP8 ulp less one, in fp32 mantissa units */
    uint32_t limit;     /* the fp32 bits from which the result is overflow */
    uint32_t denorm;    /* the magic addend that rounds a subnormal into place */
    uint32_t min_normal;/* the fp32 bits of the smallest FP8 normal */
    uint32_t overflow;  /* what a finite overflow becomes */
    float fmax;         /* torch.finfo(fp8).max */
} rdt_fp8_t;

static const rdt_fp8_t RDT_E4M3FN = {20, (uint32_t)(7 - 127) << 23, 0x7FFFFu, 1087u << 20,
                                     141u << 23, 121u << 23, 0x7Eu, 448.0f};
static const rdt_fp8_t RDT_E5M2 = {21, (uint32_t)(15 - 127) << 23, 0xFFFFFu, 143u << 23,
                                   134u << 23, 113u << 23, 0x7Cu, 57344.0f};

static inline uint8_t rdt_fp8(const rdt_fp8_t *k, float f)
{
    uint32_t u = rdt_bits(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t r;
    if (u >= k->limit)
        r = u > 0x7F800000u ? 0x7Fu : k->overflow;
    else if (u < k->min_normal)
        r = rdt_bits(rdt_float(u) + rdt_float(k->denorm)) - k->denorm;
    else
        r = (u + k->rebias + k->round + ((u >> k->shift) & 1u)) >> k->shift;
    return (uint8_t)(r | (sign >> 24));
}

/* Element at of the source, as fp32 (bf16 widens exactly). */
static inline float rdt_load(const void *src, int bf16, int64_t at)
{
    if (bf16)
        return rdt_float((uint32_t)((const uint16_t *)src)[at] << 16);
    return ((const float *)src)[at];
}

#ifdef RDT_X86
/* Four elements from at, as fp32. */
static inline __m128 rdt_load4(const void *src, int bf16, int64_t at)
{
    if (bf16)
        return _mm_castsi128_ps(_mm_unpacklo_epi16(
            _mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)((const uint16_t *)src + at))));
    return _mm_loadu_ps((const float *)src + at);
}

static inline __m128i rdt_select(__m128i mask, __m128i a, __m128i b)
{
    return _mm_or_si128(_mm_and_si128(mask, a), _mm_andnot_si128(mask, b));
}

/* rdt_fp8 of four floats, as four int32 of 0 to 255: every path computed, one kept. */
static inline __m128i rdt_fp8x4(const rdt_fp8_t *k, __m128 f)
{
    __m128i u = _mm_castps_si128(f);
    __m128i sign = _mm_and_si128(u, _mm_set1_epi32((int)0x80000000u));
    __m128i a = _mm_xor_si128(u, sign);  /* below 2^31: signed compares are exact */
    __m128i odd = _mm_and_si128(_mm_srli_epi32(a, (int)k->shift), _mm_set1_epi32(1));
    __m128i normal = _mm_add_epi32(_mm_add_epi32(a, _mm_set1_epi32((int)(k->rebias + k->round))), odd);
    normal = _mm_srli_epi32(normal, (int)k->shift);
    __m128i dn = _mm_set1_epi32((int)k->denorm);
    __m128i denorm = _mm_sub_epi32(
        _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(a), _mm_castsi128_ps(dn))), dn);
    __m128i big = rdt_select(_mm_cmpgt_epi32(a, _mm_set1_epi32(0x7F800000)),
                             _mm_set1_epi32(0x7F), _mm_set1_epi32((int)k->overflow));
    __m128i r = rdt_select(_mm_cmplt_epi32(a, _mm_set1_epi32((int)k->min_normal)), denorm, normal);
    r = rdt_select(_mm_cmpgt_epi32(a, _mm_set1_epi32((int)(k->limit - 1))), big, r);
    return _mm_and_si128(_mm_or_si128(r, _mm_srli_epi32(sign, 24)), _mm_set1_epi32(0xFF));
}
#endif

/* Fold columns [j0, j1) of the row starting at element at into the group's amax m. A
 * NaN is taken and then kept, as torch's amax propagates it. */
static float rdt_amax(const void *src, int bf16, int64_t at, int64_t j0, int64_t j1, float m)
{
    int64_t j = j0;
#ifdef RDT_X86
    if (j1 - j0 >= 4) {
        __m128 absmask = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
        __m128 vm = _mm_set1_ps(m), nan = _mm_cmpunord_ps(vm, vm);
        for (; j + 4 <= j1; j += 4) {
            __m128 x = _mm_and_ps(rdt_load4(src, bf16, at + j), absmask);
            vm = _mm_max_ps(vm, x);
            nan = _mm_or_ps(nan, _mm_cmpunord_ps(x, x));
        }
        float lanes[4];
        _mm_storeu_ps(lanes, vm);
        m = lanes[0];
        for (int l = 1; l < 4; l++)
            m = lanes[l] > m ? lanes[l] : m;
        if (_mm_movemask_ps(nan))
            m = NAN;
    }
#endif
    for (; j < j1; j++) {
        float x = fabsf(rdt_load(src, bf16, at + j));
        m = (x > m || x != x) ? x : m;
    }
    return m;
}

/* out[j] = fp8(x[j] / sc) for columns [j0, j1) of the row starting at element at. */
static void rdt_quant(const rdt_fp8_t *k, const void *src, int bf16, int64_t at, int64_t j0,
                      int64_t j1, float sc, uint8_t *out)
{
    int64_t j = j0;
#ifdef RDT_X86
    __m128 vs = _mm_set1_ps(sc);
    for (; j + 16 <= j1; j += 16) {
        __m128i r0 = rdt_fp8x4(k, _mm_div_ps(rdt_load4(src, bf16, at + j), vs));
        __m128i r1 = rdt_fp8x4(k, _mm_div_ps(rdt_load4(src, bf16, at + j + 4), vs));
        __m128i r2 = rdt_fp8x4(k, _mm_div_ps(rdt_load4(src, bf16, at + j + 8), vs));
        __m128i r3 = rdt_fp8x4(k, _mm_div_ps(rdt_load4(src, bf16, at + j + 12), vs));
        /* Values are 0 to 255: both saturating packs keep them as they are. */
        __m128i b = _mm_packus_epi16(_mm_packs_epi32(r0, r1), _mm_packs_epi32(r2, r3));
        _mm_storeu_si128((__m128i *)(out + j), b);
    }
#endif
    for (; j < j1; j++)
        out[j] = rdt_fp8(k, rdt_load(src, bf16, at + j) / sc);
}

int rdt_quantize_fp8(const void *src, int bf16, int64_t rows, int64_t cols, int64_t ld,
                     int64_t bm, int64_t bn, int fp8, uint8_t *q, float *scales)
{
    if (rows < 0 || cols < 0 || ld < cols || bm < 1 || bn < 1 || (fp8 != 0 && fp8 != 1))
        return -1;
    const rdt_fp8_t *k = fp8 ? &RDT_E5M2 : &RDT_E4M3FN;
    int64_t gc = (cols + bn - 1) / bn;
    for (int64_t r0 = 0; r0 < rows; r0 += bm) {
        int64_t r1 = r0 + bm < rows ? r0 + bm : rows;
        float *s = scales + (r0 / bm) * gc;
        for (int64_t g = 0; g < gc; g++)
            s[g] = 0.0f;
        for (int64_t i = r0; i < r1; i++)
            for (int64_t g = 0; g < gc; g++)
                s[g] = rdt_amax(src, bf16, i * ld, g * bn,
                                (g + 1) * bn < cols ? (g + 1) * bn : cols, s[g]);
        for (int64_t g = 0; g < gc; g++)
            s[g] = s[g] == 0.0f ? 1.0f : s[g] / k->fmax;
        for (int64_t i = r0; i < r1; i++)
            for (int64_t g = 0; g < gc; g++)
                rdt_quant(k, src, bf16, i * ld, g * bn,
                          (g + 1) * bn < cols ? (g + 1) * bn : cols, s[g], q + i * cols);
    }
    return 0;
}

/* The value of each FP8 byte as fp32 (exact: every FP8 value is an fp32 value), as
 * torch's FP8 -> fp32 conversion gives it: e4m3fn has no inf and one NaN pattern per
 * sign (0x7F, 0xFF); e5m2 has inf (0x7C) and NaNs above it. */
static float rdt_fp8_values[2][256];
static int rdt_fp8_ready = 0;

static void rdt_fp8_fill(void)
{
    for (uint32_t v = 0; v < 256; v++) {
        uint32_t sign = (v & 0x80u) << 24, bits;
        /* e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits. */
        uint32_t e = (v >> 3) & 0xFu, m = v & 0x7u;
        if (e == 0xFu && m == 0x7u)
            bits = 0x7FC00000u;
        else if (e == 0)
            bits = rdt_bits((float)m * 0x1p-9f);  /* m/8 * 2^-6, exact */
        else
            bits = ((e + 120u) << 23) | (m << 20);
        rdt_fp8_values[0][v] = rdt_float(bits | sign);
        /* e5m2: the top byte of an fp16 (5 exponent bits, bias 15, 2 mantissa bits). */
        e = (v >> 2) & 0x1Fu;
        m = v & 0x3u;
        if (e == 0x1Fu)
            bits = m ? 0x7FC00000u : 0x7F800000u;
        else if (e == 0)
            bits = rdt_bits((float)m * 0x1p-16f);  /* m/4 * 2^-14, exact */
        else
            bits = ((e + 112u) << 23) | (m << 21);
        rdt_fp8_values[1][v] = rdt_float(bits | sign);
    }
    rdt_fp8_ready = 1;
}

/* fp32 -> bf16 as torch rounds it: to nearest even; any NaN is 0x7FC0. */
static inline uint16_t rdt_bf16(float f)
{
    uint32_t u = rdt_bits(f);
    if (f != f)
        return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/*
 * rdt_dequantize_fp8: the receiver's side of rdt_quantize_fp8. q holds rows x cols FP8
 * bytes, contiguous (e5m2 1: float8_e5m2, else float8_e4m3fn); scales the fp32 scales of
 * its groups of bm x bn, ceil(rows / bm) x ceil(cols / bn) row-major. Writes
 * value(q) * scale, in fp32 arithmetic, into dst as fp32 (bf16 0) or rounded to bf16
 * (bf16 1), row i at element i * ld: what torch's q.float() * scale, then .to(dtype),
 * gives, bit for bit. Returns 0, or -1 for arguments it refuses.
 */
int rdt_dequantize_fp8(const uint8_t *q, int e5m2, int64_t rows, int64_t cols, int64_t bm,
                       int64_t bn, const float *scales, void *dst, int bf16, int64_t ld)
{
    if (rows < 0 || cols < 0 || ld < cols || bm < 1 || bn < 1 || (e5m2 != 0 && e5m2 != 1))
        return -1;
    if (!rdt_fp8_ready)  /* a benign race: every thread writes the same values */
        rdt_fp8_fill();
    const float *val = rdt_fp8_values[e5m2];
    int64_t gc = (cols + bn - 1) / bn;
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *in = q + i * cols;
        const float *s = scales + (i / bm) * gc;
        for (int64_t g = 0; g < gc; g++) {
            int64_t j0 = g * bn, j1 = j0 + bn < cols ? j0 + bn : cols;
            float sc = s[g];
            if (bf16) {
                uint16_t *out = (uint16_t *)dst + i * ld;
                for (int64_t j = j0; j < j1; j++)
                    out[j] = rdt_bf16(val[in[j]] * sc);
            } else {
                float *out = (float *)dst + i * ld;
                for (int64_t j = j0; j < j1; j++)
                    out[j] = val[in[j]] * sc;
            }
        }
    }
    return 0;
}
