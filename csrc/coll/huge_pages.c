/* SPDX-License-Identifier: Apache-2.0 */
/* Buffers that peers reach by the kernel's copy, on transparent huge pages.
 *
 * process_vm_readv and process_vm_writev pin the remote buffer's pages one at a time; the local side costs nothing
 * of the kind, so a remote range on 2 MiB pages moves at nearly a memcpy's speed and one on 4 KiB pages far slower
 * (benchmarks/RESULTS.md). Whether a user's buffer lies on huge pages is chance: numpy asks for them from 4 MiB,
 * where glibc happens to place the array in a range of its own, torch not at all.
 *
 * So a rank whose buffer its peers are about to reach by the kernel's copy offers it (smc_huge_pages_offer) before it
 * publishes its address: the whole huge pages inside it are collapsed (madvise MADV_COLLAPSE, Linux 6.1) the second
 * time the same range is offered. Collapsing copies the range once: a buffer seen once is left as it is, and no range
 * is collapsed twice while it stays in the table. A fresh buffer that comes back at the same place (glibc and torch
 * hand a freed large block out again) pays that copy once, and one that was mapped anew there is then as slow as any,
 * never slower. Only pages wholly inside the buffer change; contents and
 * addresses stay as they were, but parts of it never touched become resident (a collapse fills every huge page).
 * A failed collapse (a file's pages, a range marked MADV_NOHUGEPAGE, pages pinned for a device) leaves the range
 * as it was. Buffers in shared windows are never offered: every rank maps their pages, and the copies between them
 * are plain loads and stores (coll/window.c). */
#define _GNU_SOURCE
#include <stdio.h>
#include <sys/mman.h>

#include "coll/comm.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1's uapi value, for older headers */
#endif

/* Whether this kernel collapses a private anonymous range of `huge` bytes. One page of it is touched (a range with
 * no page table at all is refused), so the collapse copies that page and zeroes the rest of one huge page. */
static int collapse_works(uint64_t huge) {
  uint8_t* region = mmap(NULL, (size_t)(2 * huge), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) return 0;
  uint8_t* start = (uint8_t*)(((uintptr_t)region + huge - 1) & ~(uintptr_t)(huge - 1));
  *(volatile uint8_t*)start = 1;
  int works = madvise(start, (size_t)huge, MADV_COLLAPSE) == 0; /* EINVAL before Linux 6.1 */
  munmap(region, (size_t)(2 * huge));
  return works;
}

void smc_huge_pages_init(smc_comm_t* c, int enabled) {
  c->huge_bytes = 0;
  if (!enabled) return;
  unsigned long long bytes = 0;
  FILE* f = fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r");
  if (f == NULL) return; /* a kernel without transparent huge pages */
  if (fscanf(f, "%llu", &bytes) != 1 || bytes < SMC_PAGE || (bytes & (bytes - 1)) != 0) bytes = 0;
  fclose(f);
  c->huge_bytes = bytes > 0 && collapse_works(bytes) ? (uint64_t)bytes : 0;
}

void smc_huge_pages_offer(smc_comm_t* c, const void* p, uint64_t bytes) {
  const uint64_t h = c->huge_bytes;
  if (h == 0 || p == NULL) return;
  const uint64_t start = ((uint64_t)(uintptr_t)p + h - 1) & ~(h - 1), end = ((uint64_t)(uintptr_t)p + bytes) & ~(h - 1);
  if (end <= start || smc_window_holding(c, p, bytes) != NULL) return; /* no whole huge page inside; or shared */
  smc_offered_range_t* slot = NULL;
  for (int k = 0; k < SMC_OFFERED_RANGES && slot == NULL; k++)
    if (c->offered[k].start == start && c->offered[k].end == end) slot = &c->offered[k];
  if (slot == NULL) { /* first seen: remembered, in place of the oldest */
    slot = &c->offered[c->offered_next++ % SMC_OFFERED_RANGES];
    *slot = (smc_offered_range_t){start, end, 1};
    return;
  }
  if (slot->seen++ == 1 && madvise((void*)(uintptr_t)start, (size_t)(end - start), MADV_COLLAPSE) == 0)
    c->huge_collapses++;
}

uint64_t smc_comm_huge_collapses(smc_comm_t* c) { return c != NULL ? c->huge_collapses : 0; }
