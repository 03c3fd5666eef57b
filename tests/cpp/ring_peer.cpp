// Cross-language peer for tests/test_ring_crosslang.py.
//
//   ring_peer write NAME   fill every slot with values derived from its index, via the plain
//                          header (blink_ring.h), and publish each as PREFILL_PENDING
//   ring_peer read NAME    check what Python wrote (same derivation), through flatc's accessors
//                          (ring_generated.h); exit 0 when every field matches
//
// Including ring_layout_check.h compiles the static_asserts that tie the two headers.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "ring_layout_check.h"

namespace {

struct Mapping {
  uint8_t *base = nullptr;
  size_t size = 0;
};

bool map_ring(const char *name, Mapping *m) {
  std::string path = std::string("/dev/shm/") + name;
  int fd = open(path.c_str(), O_RDWR);
  if (fd < 0) return false;
  struct stat st;
  fstat(fd, &st);
  m->size = static_cast<size_t>(st.st_size);
  m->base = static_cast<uint8_t *>(mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  return m->base != MAP_FAILED;
}

void fill_slot(blink_slot *s, uint32_t i, int32_t *prompt) {
  s->request_id = 1000000ull + i;
  s->prompt_len = 1 + i % 7;
  s->max_new_tokens = 10 + i;
  s->generated = 3 * i;
  s->finish_reason = i % 6;
  s->error_code = i % 5;
  s->cancel = i & 1;
  s->submit_ns = 111ull * i;
  s->admit_ns = 222ull * i;
  s->first_token_ns = 333ull * i;
  s->last_token_ns = 444ull * i;
  s->sampling.temperature = 0.5f * static_cast<float>(i);
  s->sampling.top_p = 0.25f;
  s->sampling.top_k = static_cast<int32_t>(i) - 3;
  s->sampling.min_p = 0.125f;
  s->sampling.seed = 0xABCDEF0000000000ull + i;
  s->sampling.flags = i % 8;
  s->sampling.num_top_logprobs = i % 21;
  s->sampling.num_stop_ids = i % 9;
  for (int k = 0; k < 8; ++k) s->sampling.stop_ids[k] = static_cast<int32_t>(i * 10 + k);
  for (uint32_t t = 0; t < s->prompt_len; ++t) prompt[t] = static_cast<int32_t>(i * 100 + t);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  __atomic_store_n(&s->seq, i + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&s->state, BLINK_SLOT_STATE_PREFILL_PENDING, __ATOMIC_RELEASE);
}

int check_slot(const blink::ring::Slot &s, uint32_t i, const int32_t *prompt) {
  int bad = 0;
  auto expect = [&](bool ok, const char *field) {
    if (!ok) {
      std::fprintf(stderr, "slot %u: field %s differs\n", i, field);
      ++bad;
    }
  };
  expect(s.state() == blink::ring::SlotState_DECODE_COMPLETED, "state");
  expect(s.seq() == 7 * i, "seq");
  expect(s.request_id() == 5000000ull + i, "request_id");
  expect(s.prompt_len() == 2 + i % 5, "prompt_len");
  expect(s.max_new_tokens() == 20 + i, "max_new_tokens");
  expect(s.generated() == i, "generated");
  expect(s.finish_reason() == blink::ring::FinishReason_LENGTH, "finish_reason");
  expect(s.cancel() == (i % 3 == 0 ? 1u : 0u), "cancel");
  expect(s.last_token_ns() == 999ull * i, "last_token_ns");
  expect(s.sampling().temperature() == 0.75f, "sampling.temperature");
  expect(s.sampling().top_k() == static_cast<int32_t>(i), "sampling.top_k");
  expect(s.sampling().seed() == 0x1234567800000000ull + i, "sampling.seed");
  expect(s.sampling().num_stop_ids() == 2, "sampling.num_stop_ids");
  expect(s.sampling().stop_ids()->Get(1) == static_cast<int32_t>(i + 1), "sampling.stop_ids[1]");
  for (uint32_t t = 0; t < s.prompt_len(); ++t) expect(prompt[t] == static_cast<int32_t>(i + t), "prompt");
  return bad;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ring_peer write|read NAME\n");
    return 2;
  }
  Mapping m;
  if (!map_ring(argv[2], &m)) {
    std::perror("map");
    return 2;
  }
  auto *hdr = reinterpret_cast<blink_ring_header *>(m.base);
  if (hdr->schema_major != BLINK_RING_SCHEMA_MAJOR) return 3;
  auto *slots = reinterpret_cast<blink_slot *>(m.base + hdr->slots_offset);
  auto *prompts = reinterpret_cast<int32_t *>(m.base + hdr->prompt_arena_offset);
  int bad = 0;
  for (uint32_t i = 0; i < hdr->num_slots; ++i) {
    int32_t *prompt = prompts + static_cast<size_t>(i) * hdr->max_prompt_tokens;
    if (std::strcmp(argv[1], "write") == 0) {
      fill_slot(&slots[i], i, prompt);
    } else {
      const auto *fb = reinterpret_cast<const blink::ring::Slot *>(&slots[i]);
      bad += check_slot(*fb, i, prompt);
    }
  }
  std::printf("%s %u slots, %d mismatches\n", argv[1], hdr->num_slots, bad);
  return bad == 0 ? 0 : 1;
}
