/* BLAKE2b (RFC 7693), with the key, digest size and personalization of hashlib.blake2b: the hash of the
 * redaction's token chain (_chain.c), whose state is kept here in plain memory so that the chain copies
 * and finalizes it per token without a call or an allocation. Its digests are hashlib's own
 * (tests/redact/test_tokens.py checks them against each other). */
#include <stdint.h>
#include <string.h>

#define BLAKE2B_BLOCK 128
#define BLAKE2B_OUT_MAX 64
#define BLAKE2B_KEY_MAX 64
#define BLAKE2B_PERSON 16

typedef struct {
    uint64_t h[8];  /* the chained state */
    uint64_t t[2];  /* bytes hashed so far */
    size_t c;       /* bytes in b, which is compressed only when more come (the last block is special) */
    size_t outlen;
    uint8_t b[BLAKE2B_BLOCK];
} blake2b_state;

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t blake2b_load64(const uint8_t *p) {  /* little-endian */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
#else
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--)
        x = (x << 8) | p[i];
    return x;
#endif
}

static inline uint64_t blake2b_rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define BLAKE2B_G(a, b, c, d, x, y)                      \
    do {                                                 \
        v[a] += v[b] + (x);                              \
        v[d] = blake2b_rotr(v[d] ^ v[a], 32);            \
        v[c] += v[d];                                    \
        v[b] = blake2b_rotr(v[b] ^ v[c], 24);            \
        v[a] += v[b] + (y);                              \
        v[d] = blake2b_rotr(v[d] ^ v[a], 16);            \
        v[c] += v[d];                                    \
        v[b] = blake2b_rotr(v[b] ^ v[c], 63);            \
    } while (0)

static void blake2b_compress(blake2b_state *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = blake2b_load64(s->b + 8 * i);
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) {  /* unrolled: the message words' order is known at each round */
        const uint8_t *z = blake2b_sigma[r];
        BLAKE2B_G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        BLAKE2B_G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        BLAKE2B_G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        BLAKE2B_G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        BLAKE2B_G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        BLAKE2B_G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        BLAKE2B_G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        BLAKE2B_G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

static void blake2b_update(blake2b_state *s, const uint8_t *in, size_t n) {
    while (n > 0) {
        if (s->c == BLAKE2B_BLOCK) {  /* full, and more comes: it is not the last block */
            s->t[0] += BLAKE2B_BLOCK;
            s->t[1] += s->t[0] < BLAKE2B_BLOCK;
            blake2b_compress(s, 0);
            s->c = 0;
        }
        size_t take = BLAKE2B_BLOCK - s->c < n ? BLAKE2B_BLOCK - s->c : n;
        memcpy(s->b + s->c, in, take);
        s->c += take;
        in += take;
        n -= take;
    }
}

/* Parameters checked by the caller: outlen 1..64, keylen 0..64, person 0..16 bytes (zero-padded). */
static void blake2b_init(blake2b_state *s, size_t outlen, const uint8_t *key, size_t keylen,
                         const uint8_t *person, size_t personlen) {
    uint8_t padded[BLAKE2B_PERSON] = {0};
    memcpy(padded, person, personlen);
    memset(s, 0, sizeof *s);
    memcpy(s->h, blake2b_iv, sizeof s->h);
    s->h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ outlen;  /* fanout 1, depth 1 */
    s->h[6] ^= blake2b_load64(padded);
    s->h[7] ^= blake2b_load64(padded + 8);
    s->outlen = outlen;
    if (keylen > 0) {  /* the key, zero-padded, is the first block */
        uint8_t block[BLAKE2B_BLOCK] = {0};
        memcpy(block, key, keylen);
        blake2b_update(s, block, BLAKE2B_BLOCK);
    }
}

/* The digest of what s has hashed so far, s itself left as it is (hashlib's digest()). */
static void blake2b_digest(const blake2b_state *s, uint8_t out[BLAKE2B_OUT_MAX]) {
    blake2b_state last = *s;
    last.t[0] += last.c;
    last.t[1] += last.t[0] < last.c;
    memset(last.b + last.c, 0, BLAKE2B_BLOCK - last.c);
    blake2b_compress(&last, 1);
    for (size_t i = 0; i < last.outlen; i++)
        out[i] = (uint8_t)(last.h[i / 8] >> (8 * (i % 8)));
}
