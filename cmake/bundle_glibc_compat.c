/* Linked only into the GPU bundle's programs (MEGATRAIN_BUNDLE). GCC 12's static libstdc++ on
   Debian 12 seeds std::random_device with arc4random, which glibc has only since 2.36; defining it
   here (from getrandom, glibc 2.25) keeps the carried programs loadable on a GPU machine with an
   older glibc, such as Ubuntu 22.04's 2.35. */
#include <stdint.h>
#include <sys/random.h>

uint32_t arc4random(void) {
  uint32_t v = 0;
  while (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
  }
  return v;
}
