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
 * Threads: rdt_stream_copy and rdt_copy_moves run on their caller's thread and touch no
 * Python state; ctypes releases the GIL around them, so the pack threads copy in
 * parallel.
 */
#include <stddef.h>
#include <stdint.h>
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
