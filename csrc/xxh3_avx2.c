/* The AVX2 build of xxh3-128's update loop, chosen at import by recv_verify.c when the CPU has
 * AVX2 (the build itself assumes only the x86-64 baseline, SSE2). xxHash comes from the system's
 * header (Debian/Ubuntu: libxxhash-dev), inlined, so nothing links against libxxhash. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2")
#include <stddef.h>

#define XXH_INLINE_ALL
#define XXH_VECTOR 2 /* XXH_AVX2 */
#include <xxhash.h>

void memkv_xxh3_update_avx2(XXH3_state_t *state, const void *data, size_t len) {
    (void)XXH3_128bits_update(state, data, len);
}
#endif
