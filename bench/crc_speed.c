/* crc_speed.c: kvl_crc32c throughput on a cached (512 KiB) and a DRAM-sized
 * (64 MiB) buffer.  Build and run (docs/BENCHMARKS.md):
 *   gcc -O2 -D_GNU_SOURCE -Icsrc/include -Icsrc bench/crc_speed.c csrc/crc32c.c -lpthread -o /tmp/crc
 * Add -DKVL_CRC32C_NO_CLMUL to measure the three-lane crc32 code instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
uint32_t kvl_crc32c(uint32_t, const void*, size_t);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  size_t sizes[]={512<<10, 64<<20};
  for(int k=0;k<2;k++){ size_t n=sizes[k]; unsigned char*b=malloc(n); for(size_t i=0;i<n;i++)b[i]=i*7;
    uint32_t c=0; size_t reps = (1ull<<32)/n; double t=now(); for(size_t r=0;r<reps;r++) c=kvl_crc32c(c,b,n); t=now()-t;
    printf("%zu bytes: %.1f GB/s (%08x)\n", n, reps*(double)n/t/1e9, c); }
}
