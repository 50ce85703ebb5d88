// SPDX-License-Identifier: Apache-2.0
// The file formats of sharded checkpoints, alone: CRC-32C (its standard check value, the instruction and the tables
// agreeing on random data, continuation), the JSON parser (every construct, the exact integers, the errors),
// safetensors files (written, read back, and refused when their header is wrong), and the manifest (written, parsed
// back, refused).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <clocale>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/cases.hpp"
#include "support/temp_path.hpp"
#include "tandem/core/atomic_file.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/crc32c.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/json.hpp"
#include "tandem/core/safetensors.hpp"

namespace {

// The file at `path` and the temporary files of it (`path`.tmp.*): what a writer of it left.
int files_named_like(const std::string& path) {
  const std::filesystem::path p(path);
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(p.parent_path()))
    n += e.path().filename().string().starts_with(p.filename().string());
  return n;
}

}  // namespace

TEST_CASE("CRC-32C: the check value; every implementation this host runs agrees with the tables; it continues") {
  using namespace tandem::detail;
  const char* text = "123456789";
  CHECK(crc32c(text, 9) == 0xE3069283u);
  CHECK(~crc32c_software(~0u, reinterpret_cast<const unsigned char*>(text), 9) == 0xE3069283u);
  std::mt19937 rng(5);
  std::vector<unsigned char> data(100003 + 3);
  for (unsigned char& c : data) c = static_cast<unsigned char>(rng());
  // The implementations on the running CRC (not inverted), each against the tables where this host has it.
  std::vector<std::pair<const char*, std::uint32_t (*)(std::uint32_t, const unsigned char*, std::size_t)>> ways;
#if TANDEM_CRC32C_SSE42
  if (crc32c_has_sse42()) ways.emplace_back("sse4.2", &crc32c_sse42);
  if (crc32c_has_vpclmul()) ways.emplace_back("vpclmulqdq", &crc32c_vpclmul);  // (n >= 256)
#endif
  MESSAGE("CRC-32C implementations checked beside the tables: " << ways.size());
  // Lengths around the folding's 16-, 64- and 256-byte blocks and the interleaved blocks of 3 * crc32c_stream_bytes
  // (one, one and a remainder, several), at every alignment mod 4 and from two running values.
  const std::size_t block = 3 * crc32c_stream_bytes;
  for (std::size_t n : {std::size_t{0},
                        std::size_t{1},
                        std::size_t{7},
                        std::size_t{8},
                        std::size_t{9},
                        std::size_t{255},
                        std::size_t{256},
                        std::size_t{257},
                        std::size_t{271},
                        std::size_t{272},
                        std::size_t{319},
                        std::size_t{320},
                        std::size_t{511},
                        std::size_t{512},
                        std::size_t{1000},
                        block - 1,
                        block,
                        block + 9,
                        2 * block + 8,
                        std::size_t{100003}}) {
    CAPTURE(n);
    for (std::size_t offset = 0; offset < 4; ++offset)
      for (const std::uint32_t running : {0xFFFFFFFFu, 0x12345678u}) {
        const std::uint32_t expected = crc32c_software(running, data.data() + offset, n);
        for (const auto& [name, way] : ways) {
          if (n < 256 && std::string(name) == "vpclmulqdq") continue;
          CAPTURE(name);
          CHECK(way(running, data.data() + offset, n) == expected);
        }
      }
    const std::uint32_t whole = crc32c(data.data(), n);
    CHECK(~crc32c_software(~0u, data.data(), n) == whole);
    for (std::size_t cut : {std::size_t{0}, n / 3, n}) {  // CRC of a part, continued over the rest
      const std::uint32_t first = crc32c(data.data(), cut);
      CHECK(crc32c(data.data() + cut, n - cut, first) == whole);
    }
  }
}

TEST_CASE("JSON: every construct parses, integers stay exact, and malformed text is an error naming the byte") {
  using tandem::detail::json::parse;
  using Kind = tandem::detail::json::Value::Kind;
  const auto v = parse(
      R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "x\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"},
           "big": 18446744073709551615, "over": 18446744073709551616, "e": []} )",
      "test");
  REQUIRE(v.kind == Kind::object);
  const auto* a = v.find("a");
  REQUIRE(a != nullptr);
  REQUIRE(a->items.size() == 5);
  CHECK(a->items[0].is_count);
  CHECK(a->items[0].count == 1);
  CHECK(a->items[1].number == -2500.0);
  CHECK_FALSE(a->items[1].is_count);
  CHECK(a->items[2].boolean);
  CHECK(a->items[4].kind == Kind::null);
  CHECK(v.find("b")->find("c")->string == "x\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(v.find("big")->count == UINT64_MAX);
  CHECK_FALSE(v.find("over")->is_count);
  CHECK(v.find("e")->items.empty());
  CHECK(tandem::detail::json::quote("a\"b\\c\nd\x01") == "\"a\\\"b\\\\c\\nd\\u0001\"");
  CHECK(parse(tandem::detail::json::quote("\x01\x1f\"\\ é"), "round trip").string == "\x01\x1f\"\\ é");
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "\"abc", "\"\\x\"", "01", "1.", "1e", "tru", "[1] 2",
                          "\"\\ud800\"", "\"\\udc00\"", "\"a\nb\""}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(parse(bad, "the input"), doctest::Contains("the input is not valid JSON"), tandem::error);
  }
  std::string deep(100, '[');
  CHECK_THROWS_WITH_AS(parse(deep, "deep"), doctest::Contains("nested more than 64 deep"), tandem::error);
  // Text that is not UTF-8 (RFC 8259): a lone continuation byte, a truncated sequence, overlong forms, a surrogate,
  // past U+10FFFF, bytes UTF-8 never uses; named by the byte, after a run of ASCII read 8 bytes at a time.
  for (const char* bad : {"\x80", "\xc3", "\xc0\x80", "\xe0\x80\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80",
                          "\xf5\x80\x80\x80", "\xff", "\xe2\x82"}) {
    CAPTURE(bad);
    const std::string text = "[\"0123456789abcdef" + std::string(bad) + "\"]";
    CHECK(tandem::detail::json::utf8_prefix(text) == 18);
    CHECK_THROWS_WITH_AS(parse(text, "the input"), doctest::Contains("not part of UTF-8 (at byte 18)"), tandem::error);
  }
  for (const char* good :
       {"\xc2\x80", "\xe0\xa0\x80", "\xed\x9f\xbf", "\xee\x80\x80", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf"}) {
    CAPTURE(good);
    const std::string text = "[\"0123456789abcdef" + std::string(good) + "\"]";
    CHECK(tandem::detail::json::utf8_prefix(text) == text.size());
    CHECK(parse(text, "the input").items.at(0).string == "0123456789abcdef" + std::string(good));
  }
}

TEST_CASE("NameIndex: names chosen to share a few slots of the stable hash spread over the index all the same") {
  // 20,000 names whose stable FNV-1a puts them into the first 1,024 of 65,536 slots (how a hostile file would choose
  // its tensor names): an index by that hash steps over about n^2/2 occupied slots building them (quadratic), one by
  // the process's seeded hash about as few as for any names.
  constexpr std::size_t n = 20000, slots = 65536, window = 1024;
  std::vector<std::string> names;
  for (std::uint64_t c = 0; names.size() < n; ++c) {
    std::string name = "t" + std::to_string(c);
    if ((tandem::detail::fnv1a(name) & (slots - 1)) < window) names.push_back(std::move(name));
  }
  tandem::detail::NameIndex index;
  const auto name_of = [&](std::size_t k) -> std::string_view { return names[k]; };
  CHECK(index.build(n, name_of) == n);
  CHECK(index.probes() < 2 * n);
  for (std::size_t k = 0; k < n; k += 97) CHECK(index.find(names[k], name_of) == k);
  CHECK(index.find("absent", name_of) == tandem::detail::NameIndex::none);
  names[n - 1] = names[3];  // a repeated name is found, whichever slots they take
  CHECK(index.build(n, name_of) == n - 1);
}

TEST_CASE("safetensors: written in pieces, read back by range, and refused when the header lies") {
  const std::string path = test::temp_path("format") + ".safetensors";
  std::vector<float> a(1000);
  std::vector<std::uint16_t> b(77);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = 0.5f * static_cast<float>(i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::uint16_t>(i * 3);
  {
    tandem::SafetensorsWriter w(path,
                                {{"a", tandem::DType::fp32, a.size()},
                                 {"b[0:77]", tandem::DType::bf16, b.size()},
                                 {"empty", tandem::DType::fp16, 0}},
                                {{"format", "pt"}}, "the test file");
    w.data(a.data(), 100);  // pieces that cross the tensors' boundaries
    w.data(reinterpret_cast<const char*>(a.data()) + 100, a.size() * 4 - 100);
    w.data(b.data(), b.size() * 2);
    const tandem::SafetensorsSummary s = w.commit();
    CHECK(s.bytes == std::filesystem::file_size(path));
  }
  const tandem::SafetensorsFile f(path);
  REQUIRE(f.tensors().size() == 3);
  CHECK(*f.metadata("format") == "pt");
  const auto* tb = f.find("b[0:77]");
  REQUIRE(tb != nullptr);
  CHECK(tb->dtype == tandem::DType::bf16);
  CHECK(std::ranges::equal(tb->shape, std::vector<std::uint64_t>{77}));
  std::vector<std::uint16_t> back(77);
  f.read(tb->begin, back.data(), back.size() * 2);
  CHECK(back == b);
  std::uint32_t crc = 0;
  CHECK(f.recorded_crc("a", crc));
  CHECK(crc == tandem::detail::crc32c(a.data(), a.size() * 4));
  std::remove(path.c_str());
  // Headers that lie: each refused by tandem::parse_safetensors_header with what is wrong.
  const std::string ok = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(tandem::parse_safetensors_header(ok, 8, "h").tensors.size() == 1);
  const std::pair<std::string, const char*> lies[] = {
      {ok, "do not cover its data section"},  // with 9 data bytes, below
      {R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "do not match its shape"},
      {R"({"x":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", "tandem reads F32"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "does not start where"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       "names `x` twice"},
      {R"({"__metadata__":{"k":1}})", "is not a string"},
      {R"( {})", "does not start with '{'"},
      {R"({"x":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", "overflows"},
  };
  for (const auto& [text, why] : lies) {
    CAPTURE(text);
    CHECK_THROWS_WITH_AS(tandem::parse_safetensors_header(text, text == ok ? 9 : 8, "h"), doctest::Contains(why),
                         tandem::error);
  }
}

TEST_CASE("safetensors: pieces written in place, copied or whole, adjacent or scattered, land in order") {
  const std::string path = test::temp_path("pieces") + ".safetensors";
  std::vector<float> a(5000), b(300000), c(4000), c_back(2000);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i) * 0.5f;
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = static_cast<float>(i) * 0.25f;
  {
    tandem::SafetensorsWriter w(path,
                                {{"a", tandem::DType::fp32, a.size()},
                                 {"b", tandem::DType::fp32, b.size()},
                                 {"c", tandem::DType::fp32, c.size() / 2}},
                                {}, "the test file");
    for (std::size_t i = 0; i < a.size(); i += 2) w.data_in_place(&a[i], 8);  // adjacent: joined
    w.data(b.data(), b.size() * 4);                                           // over 1 MiB: written whole
    for (std::size_t i = 0; i < c.size(); i += 2) {  // every other element: 2,000 pieces, over a call's most
      if (i % 4 == 0)
        w.data_in_place(&c[i], 4);
      else
        w.data(&c[i], 4);
    }
    w.commit();
  }
  const tandem::SafetensorsFile f(path);
  std::vector<float> a_back(a.size()), b_back(b.size());
  f.read(f.find("a")->begin, a_back.data(), a_back.size() * 4);
  f.read(f.find("b")->begin, b_back.data(), b_back.size() * 4);
  f.read(f.find("c")->begin, c_back.data(), c_back.size() * 4);
  CHECK(a_back == a);
  CHECK(b_back == b);
  for (std::size_t i = 0; i < c_back.size(); ++i) REQUIRE(c_back[i] == c[2 * i]);
  std::uint32_t crc = 0;
  CHECK(f.recorded_crc("c", crc));
  CHECK(crc == tandem::detail::crc32c(c_back.data(), c_back.size() * 4));
  std::remove(path.c_str());
}

TEST_CASE("a checkpoint's directory is created with its missing parents, and a file in the way is named") {
  const std::string root = test::temp_path("durable_dirs");
  tandem::detail::create_directories_durably(root + "/a/b/");  // (each new entry flushed into its parent)
  CHECK(std::filesystem::is_directory(root + "/a/b"));
  tandem::detail::create_directories_durably(root + "/a/b");  // there already: nothing to do
  std::FILE* f = std::fopen((root + "/file").c_str(), "w");
  REQUIRE(f != nullptr);
  std::fclose(f);
  const std::string named = "cannot create the directory `" + root + "/file/c`";
  CHECK_THROWS_WITH_AS(tandem::detail::create_directories_durably(root + "/file/c"), doctest::Contains(named.c_str()),
                       tandem::error);
  std::filesystem::remove_all(root);
}

TEST_CASE("safetensors: a file the disk has no room for fails before anything is written, and leaves nothing") {
  const std::string path = test::temp_path("no_room") + ".safetensors";
  bool reserves = false;  // whether the file system reserves space ahead (fallocate)
#ifdef __linux__
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    REQUIRE(fd >= 0);
    reserves = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 4096) == 0;
    ::close(fd);
    std::filesystem::remove(path);
  }
#endif
  if (!reserves)
    test::skip_case("the file system of " + std::filesystem::path(path).parent_path().string() +
                    " does not reserve space ahead (no fallocate)");
  // 2^48 fp32 elements, 1 PiB: past ext4's largest file and any disk's free space.
  const auto write = [&] {
    tandem::SafetensorsWriter w(path, {{"huge", tandem::DType::fp32, std::uint64_t{1} << 48}}, {}, "the test file");
  };
  CHECK_THROWS_WITH_AS(write(), doctest::Contains("no room on the disk for the test file"), tandem::error);
  CHECK(files_named_like(path) == 0);
}

TEST_CASE("safetensors: a header over the readers' 100,000,000 bytes is refused on write, before anything is written") {
  const std::string path = test::temp_path("huge_header") + ".safetensors";
  // one long name: the header is that and the entry's JSON around it (some 60 bytes), over the reference reader's
  // 100,000,000 bytes and under 100 MiB
  const auto write = [&](std::size_t name_bytes) {
    tandem::SafetensorsWriter w(path, {{std::string(name_bytes, 'n'), tandem::DType::fp32, 1}}, {}, "the test file");
    const float x = 1.0f;
    w.data(&x, sizeof x);
    w.commit();
  };
  CHECK_THROWS_WITH_AS(write(99'999'990), doctest::Contains("the test file would have a header of"), tandem::error);
  CHECK(files_named_like(path) == 0);
  write(std::size_t{1} << 20);  // a 1 MiB name is written, and read back
  CHECK(tandem::SafetensorsFile(path).tensors().at(0).name.size() == std::size_t{1} << 20);
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: the checksums in one metadata value in data order, or per name as earlier files have them") {
  // (Read only from files of tandem's: those that say so, and shards and consolidated files of earlier versions.)
  using tandem::parse_safetensors_header;
  // Two tensors whose header order is not their data order: the digits go by the data.
  const std::string entries =
      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const tandem::SafetensorsHeader h = parse_safetensors_header(
      R"({"__metadata__":{"crc32c":"0000000a0000000b","k":"v","tandem_checksums":"crc32c"},)" + entries + "}", 8, "h");
  REQUIRE(h.find("a") != nullptr);
  CHECK(h.find("a")->has_crc);
  CHECK(h.find("a")->crc == 0xau);
  CHECK(h.find("b")->crc == 0xbu);
  CHECK(h.find_metadata("crc32c") == nullptr);  // (parsed into the tensors)
  CHECK(*h.find_metadata("k") == "v");
  // The earlier form: a key per tensor (and one of no tensor kept as metadata).
  const tandem::SafetensorsHeader earlier = parse_safetensors_header(
      R"({"__metadata__":{"crc32c/a":"0000000c","crc32c/zz":"00000001","format":"tandem-checkpoint-shard"},)" +
          entries + "}",
      8, "h");
  CHECK(earlier.find("a")->crc == 0xcu);
  CHECK(!earlier.find("b")->has_crc);
  CHECK(*earlier.find_metadata("crc32c/zz") == "00000001");
  for (const char* digits : {"0000000a", "0000000a0000000b0", "0000000a0000000G"}) {
    CAPTURE(digits);
    const std::string header =
        R"({"__metadata__":{"tandem_step":"3","crc32c":")" + std::string(digits) + R"("},)" + entries + "}";
    CHECK_THROWS_WITH_AS(
        parse_safetensors_header(header, 8, "h"),
        doctest::Contains(std::string(digits).size() == 16 ? "is not 8 hex digits" : "not 8 hex digits for each"),
        tandem::error);
  }
  // Another writer's file: its keys of those names are its own metadata (a whole file's checksum, say), well-formed
  // as checksums or not.
  for (const char* digits : {"0000000a0000000b", "deadbeef"}) {
    CAPTURE(digits);
    const tandem::SafetensorsHeader other = parse_safetensors_header(
        R"({"__metadata__":{"format":"pt","crc32c":")" + std::string(digits) + R"(","crc32c/a":"x"},)" + entries + "}",
        8, "h");
    CHECK(!other.find("a")->has_crc);
    CHECK(!other.find("b")->has_crc);
    CHECK(*other.find_metadata("crc32c") == digits);
    CHECK(*other.find_metadata("crc32c/a") == "x");
  }
  // The writer keeps the keys for itself, and says its checksums are tandem's.
  const std::string path = test::temp_path("crc_key") + ".safetensors";
  for (const char* key : {"crc32c", "tandem_checksums"}) {
    const auto write = [&] { tandem::SafetensorsWriter w(path, {{"a", tandem::DType::fp32, 1}}, {{key, "x"}}, "f"); };
    const std::string refused = "cannot take metadata `" + std::string(key) + "`";
    CHECK_THROWS_WITH_AS(write(), doctest::Contains(refused.c_str()), tandem::error);
    CHECK(!std::filesystem::exists(path));
  }
  const float two = 2.0f;
  {
    tandem::SafetensorsWriter w(path, {{"a", tandem::DType::fp32, 1}}, {{"format", "pt"}}, "f");
    w.data(&two, sizeof two);
    w.commit();
  }
  const tandem::SafetensorsFile written(path);
  CHECK(written.tensors().at(0).has_crc);
  CHECK(written.tensors().at(0).crc == tandem::detail::crc32c(&two, sizeof two));
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: the writer refuses names a reader could not tell apart, and writes nothing") {
  const std::string path = test::temp_path("names") + ".safetensors";
  const tandem::DType f = tandem::DType::fp32;
  const auto write = [&](std::vector<tandem::SafetensorsEntry> entries) {
    tandem::SafetensorsWriter w(path, std::move(entries), {}, "the test file");
  };
  CHECK_THROWS_WITH_AS(write({{"a", f, 1}, {"b", f, 1}, {"a", f, 2}}),
                       doctest::Contains("the test file would hold two tensors named `a`"), tandem::error);
  CHECK(!std::filesystem::exists(path));
  // A reader takes `__metadata__` for the file's metadata: such a tensor would be read back as a broken header.
  CHECK_THROWS_WITH_AS(write({{"a", f, 1}, {"__metadata__", f, 1}}),
                       doctest::Contains("the test file would hold a tensor named `__metadata__`"), tandem::error);
  CHECK(!std::filesystem::exists(path));
  // Names and metadata that are not UTF-8: no safetensors reader takes such a header (the reference one refuses it).
  CHECK_THROWS_WITH_AS(write({{"a", f, 1}, {"lay\xe9r.w", f, 1}}),
                       doctest::Contains("the test file would hold a tensor name that is not UTF-8 from byte 3 on "
                                         "(`lay` before it)"),
                       tandem::error);
  CHECK_THROWS_WITH_AS((tandem::SafetensorsWriter(path, {{"a", f, 1}}, {{"k", "\xff"}}, "the test file")),
                       doctest::Contains("the test file would hold a metadata value that is not UTF-8"), tandem::error);
  CHECK(!std::filesystem::exists(path));
  {
    tandem::SafetensorsWriter w(path, {{"a", f, 1}, {"__metadata__x", f, 1}, {"A", f, 1}}, {}, "the test file");
    const float values[3] = {1, 2, 3};
    w.data(values, sizeof values);
    w.commit();
  }
  const tandem::SafetensorsFile file(path);  // names that differ in any byte are three tensors
  CHECK(file.tensors().size() == 3);
  CHECK(file.find("__metadata__x") != nullptr);
  std::filesystem::remove(path);
}

TEST_CASE("safetensors: names and shapes are views of the header, valid after the text parsed and the header moved") {
  // Names with and without escapes, shapes of several ranks, entries in both forms; the text parsed is gone before
  // they are read, and the header has been moved twice.
  std::optional<tandem::SafetensorsHeader> kept;
  {
    std::string text = R"({"plain":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                       R"("esc\"aped\u00e9":{ "shape" : [4], "dtype" : "BF16", "data_offsets" : [24, 32] },)"
                       R"("scalar":{"dtype":"F64","shape":[],"data_offsets":[32,40]},)"
                       R"("w":{"dtype":"F16","shape":[1,2,1,3,1],"data_offsets":[40,52]}})";
    tandem::SafetensorsHeader h = tandem::parse_safetensors_header(text, 52, "h");
    std::fill(text.begin(), text.end(), '#');
    tandem::SafetensorsHeader moved(std::move(h));
    kept.emplace(std::move(moved));
  }
  const tandem::SafetensorsHeader& h = *kept;
  const std::vector<std::pair<std::string, std::vector<std::uint64_t>>> expected = {
      {"plain", {2, 3}}, {"esc\"aped\xc3\xa9", {4}}, {"scalar", {}}, {"w", {1, 2, 1, 3, 1}}};
  REQUIRE(h.tensors.size() == expected.size());
  for (std::size_t k = 0; k < expected.size(); ++k) {
    CAPTURE(k);
    CHECK(h.tensors[k].name == expected[k].first);
    CHECK(std::ranges::equal(h.tensors[k].shape, expected[k].second));
    CHECK(h.find(expected[k].first) == &h.tensors[k]);
  }
  CHECK(h.tensors[1].count() == 4);
  CHECK(h.tensors[2].count() == 1);
  CHECK(h.tensors[3].count() == 6);
}

TEST_CASE("safetensors: an entry in any valid form parses as the same entry in the writers' form") {
  // The writers' form (matched byte for byte), then the same entry with white space, its members in another order,
  // an unknown member, or numbers too long for the quick path; each must give the same tensor.
  const std::pair<std::string, std::vector<std::uint64_t>> forms[] = {
      {R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]})", {2, 3}},
      {R"({ "dtype" : "BF16", "shape" : [ 2 , 3 ], "data_offsets" : [ 0 , 12 ] })", {2, 3}},
      {R"({"shape":[2,3],"data_offsets":[0,12],"dtype":"BF16"})", {2, 3}},
      {R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,12],"x":[1]})", {2, 3}},
      {R"({"dtype":"BF16","shape":[6],"data_offsets":[0,0000000000000000000012]})", {}},  // (not JSON: refused)
      {R"({"dtype":"BF16","shape":[00000000000000000006],"data_offsets":[0,12]})", {}},
      {R"({"dtype":"BF16","shape":[6],"data_offsets":[0,12.0]})", {}},
      {R"({"dtype":"BF16","shape":[],"data_offsets":[0,2]})", {}},       // a scalar: one element
      {R"({"dtype":"F32BF16","shape":[6],"data_offsets":[0,12]})", {}},  // a dtype's name with more after it: none
      {R"({"dtype":"BF16F64","shape":[6],"data_offsets":[0,12]})", {}},
  };
  for (const auto& [entry, shape] : forms) {
    CAPTURE(entry);
    const std::string header = "{\"t\":" + entry + "}";
    const bool scalar = entry.find("[]") != std::string::npos;
    const bool valid = !shape.empty() || scalar;
    if (!valid) {
      CHECK_THROWS_AS(tandem::parse_safetensors_header(header, 12, "h"), tandem::error);
      continue;
    }
    const tandem::SafetensorsHeader h = tandem::parse_safetensors_header(header, scalar ? 2 : 12, "h");
    REQUIRE(h.tensors.size() == 1);
    CHECK(h.tensors[0].dtype == tandem::DType::bf16);
    CHECK(std::ranges::equal(h.tensors[0].shape, shape));
    CHECK(h.tensors[0].end == (scalar ? 2u : 12u));
  }
  // A 20-digit offset (below 2^64) is exact; one of 2^64 or more is not a size.
  const std::string big =
      R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})";
  CHECK_THROWS_WITH_AS(tandem::parse_safetensors_header(big, 0, "h"), doctest::Contains("does not start where"),
                       tandem::error);
  const std::string over = R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[18446744073709551616,0]}})";
  CHECK_THROWS_WITH_AS(tandem::parse_safetensors_header(over, 0, "h"), doctest::Contains("are not sizes"),
                       tandem::error);
}

namespace {

// `text` with its first `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  REQUIRE(text.find(from) != std::string::npos);
  return text.replace(text.find(from), from.size(), to);
}

// Each manifest text is refused by parse_manifest with a message that holds its reason.
template <std::size_t N>
void check_refused(const std::pair<std::string, const char*> (&manifests)[N]) {
  for (const auto& [text, why] : manifests) {
    CAPTURE(why);
    CHECK_THROWS_WITH_AS(tandem::detail::parse_manifest(text, "m"), doctest::Contains(why), tandem::error);
  }
}

}  // namespace

TEST_CASE("the manifest: written, parsed back the same, and refused when incomplete or of another version") {
  tandem::CheckpointManifest m;
  m.step = 12;
  m.skipped_steps = 3;
  m.policy = "GradientSharded";
  m.world_size = 2;
  m.optimizer = "AdamW";
  m.optimizer_fingerprint = 0x0123456789abcdefull;
  m.state_count = 2;
  m.param_dtype = tandem::DType::bf16;
  m.bucket_cap_bytes = 1 << 20;
  m.first_bucket_cap_bytes = 4096;
  m.tensors = {{"w \"quoted\"", 10, tandem::DType::bf16}, {"b", 3, tandem::DType::bf16}};
  m.files = {{"r0.safetensors", 100, 0xdeadbeef}, {"r1.safetensors", 200, 7}};
  const std::string text = tandem::detail::manifest_json(m);
  const tandem::CheckpointManifest back = tandem::detail::parse_manifest(text, "m");
  CHECK(back.step == 12);
  CHECK(back.skipped_steps == 3);
  CHECK(back.optimizer_fingerprint == m.optimizer_fingerprint);
  CHECK(back.param_dtype == tandem::DType::bf16);
  CHECK(back.tensors[0].name == "w \"quoted\"");
  CHECK(back.files[0].header_crc == 0xdeadbeef);
  CHECK(back.files[1].bytes == 200);
  CHECK(back.bucket_cap_bytes == m.bucket_cap_bytes);
  {  // the members in another order, with white space and members it does not know
    const std::string reordered =
        "{\"files\": [{\"header_crc32c\": \"000000ff\", \"extra\": [1, {\"a\": null}], \"bytes\": 5, \"name\": "
        "\"f\"}],\n"
        " \"tensors\": [ {\"dtype\": \"fp32\", \"numel\": 7, \"name\": \"t\"} ], \"parameters_only\": true,"
        " \"first_bucket_cap_bytes\": 0, \"bucket_cap_bytes\": 0, \"param_dtype\": \"fp32\", \"state_count\": 0,"
        " \"optimizer_fingerprint\": \"0000000000000000\", \"optimizer\": \"\", \"world_size\": 1, \"policy\": "
        "\"imported\","
        " \"step\": 0, \"version\": 2, \"format\": \"tandem-checkpoint\", \"more\": {\"x\": 1}}";
    const tandem::CheckpointManifest r = tandem::detail::parse_manifest(reordered, "r");
    REQUIRE(r.tensors.size() == 1);
    CHECK(r.tensors[0].name == "t");
    CHECK(r.tensors[0].numel == 7);
    REQUIRE(r.files.size() == 1);
    CHECK(r.files[0].bytes == 5);
    CHECK(r.files[0].header_crc == 0xffu);
    CHECK(r.parameters_only);
    CHECK(r.skipped_steps == 0);  // (a manifest of a save before skipped_steps was recorded has none)
  }
  auto broken = [&](const std::string& from, const std::string& to) { return replaced(text, from, to); };
  const std::pair<std::string, const char*> bad[] = {
      {broken("\"version\": 2", "\"version\": 3"), "format version 3"},
      {broken("\"tandem-checkpoint\"", "\"other\""), "is not a tandem checkpoint manifest"},
      {broken("\"step\": 12,", ""), "lacks `step`"},
      {broken("\"skipped_steps\": 3", "\"skipped_steps\": -3"), "an implausible `skipped_steps`"},
      {broken("\"skipped_steps\": 3", "\"skipped_steps\": \"3\""), "lacks `skipped_steps`"},
      {broken("r1.safetensors", "../r1.safetensors"), "outside its directory"},
      {broken("\"world_size\": 2", "\"world_size\": 3"), "lists 2 files for 3 ranks"},
      {broken("\"dtype\": \"bf16\"", "\"dtype\": \"fp32\""), "a dtype other than param_dtype"},
      {broken("\"numel\": 10", "\"numel\": -10"), "an implausible `numel`"},
      {broken("\"bytes\": 100", "\"bytes\": 1.5"), "an implausible `bytes`"},
      {broken("\"numel\": 10", "\"numel\": \"10\""), "lacks `numel`"},
      {broken("\"tensors\": [", "\"tensors\": 7, \"x\": ["), "lacks `tensors`"},
      {"[1, 2]", "lacks `format`"},
      {broken("\"files\": [", "\"files\": [1, "), "lacks `name`"},
  };
  check_refused(bad);
}

TEST_CASE("the manifest's optimizer groups: written by name, parsed back exactly, and refused where inconsistent") {
  tandem::CheckpointManifest m;
  m.optimizer = "AdamW";
  m.state_count = 0;  // (what parse_manifest checks of it: 0 in a parameters-only manifest, below)
  m.world_size = 1;
  m.tensors = {{"w", 10, tandem::DType::fp32}, {"b", 3, tandem::DType::fp32}, {"g", 4, tandem::DType::fp32}};
  m.files = {{"r0.safetensors", 100, 1}};
  m.optimizer_groups = {{{"lr", 1e-3f}, {"beta1", 0.9f}, {"eps", 1e-8f}}, {{"lr", 3e-4f}, {"beta1", 0.0}}};
  m.optimizer_group_of = {0, 1, 0};
  const std::string text = tandem::detail::manifest_json(m);
  // each value as the shortest text of its float
  CHECK(text.find("\"optimizer_groups\": [{\"lr\": 0.001, \"beta1\": 0.9, \"eps\": 1e-08}, {\"lr\": 3e-04, "
                  "\"beta1\": 0}]") != std::string::npos);
  CHECK(text.find("\"optimizer_group_of\": [0, 1, 0]") != std::string::npos);
  const tandem::CheckpointManifest back = tandem::detail::parse_manifest(text, "m");
  REQUIRE(back.optimizer_groups.size() == 2);
  for (std::size_t g = 0; g < 2; ++g) {
    REQUIRE(back.optimizer_groups[g].size() == m.optimizer_groups[g].size());
    for (std::size_t k = 0; k < m.optimizer_groups[g].size(); ++k) {
      CHECK(back.optimizer_groups[g][k].first == m.optimizer_groups[g][k].first);
      CHECK(static_cast<float>(back.optimizer_groups[g][k].second) ==
            static_cast<float>(m.optimizer_groups[g][k].second));
    }
  }
  CHECK(back.optimizer_group_of == m.optimizer_group_of);
  {  // one group: no assignment written; none at all: neither member (a manifest of a save before they were recorded)
    tandem::CheckpointManifest one = m;
    one.optimizer_groups.resize(1);
    one.optimizer_group_of.clear();
    const std::string t = tandem::detail::manifest_json(one);
    CHECK(t.find("optimizer_group_of") == std::string::npos);
    CHECK(tandem::detail::parse_manifest(t, "m").optimizer_groups.size() == 1);
    one.optimizer_groups.clear();
    CHECK(tandem::detail::manifest_json(one).find("optimizer_groups") == std::string::npos);
    CHECK(tandem::detail::parse_manifest(tandem::detail::manifest_json(one), "m").optimizer_groups.empty());
  }
  auto broken = [&](const std::string& from, const std::string& to) { return replaced(text, from, to); };
  const std::pair<std::string, const char*> bad[] = {
      {broken("\"lr\": 0.001", "\"lr\": \"0.001\""), "optimizer option `lr` that is not a finite number"},
      {broken("\"lr\": 0.001", "\"lr\": 1e999"), "optimizer option `lr` that is not a finite number"},
      {broken("\"beta1\": 0.9", "\"lr\": 0.9"), "optimizer option `lr` twice"},
      {broken("[0, 1, 0]", "[0, 1]"), "gives 2 tensors an optimizer group, but holds 3"},
      {broken("[0, 1, 0]", "[0, 2, 0]"), "an optimizer group that optimizer_groups does not hold"},
      {broken("[0, 1, 0]", "[0, -1, 0]"), "an optimizer group that optimizer_groups does not hold"},
      {broken(",\n \"optimizer_group_of\": [0, 1, 0]", ""), "holds 2 optimizer groups but no optimizer_group_of"},
      {broken("\"optimizer_groups\": [", "\"optimizer_groups\": [7, "), "lacks `optimizer_groups`"},
      {broken("\"parameters_only\": false", "\"parameters_only\": true"), "is parameters-only but holds state"},
  };
  check_refused(bad);
}

namespace {

// Sets LC_NUMERIC to a locale whose decimal point is a comma, as a program's setlocale(LC_ALL, "") may: de_DE.UTF-8,
// made with localedef in a temporary directory where it is not installed. False where none can be had.
bool comma_decimal_locale() {
  if (std::setlocale(LC_NUMERIC, "de_DE.UTF-8") != nullptr) return true;
  const std::string dir = test::temp_path("locales");
  std::filesystem::create_directories(dir);
  (void)std::system(("localedef -i de_DE -f UTF-8 '" + dir + "/de_DE.UTF-8' >/dev/null 2>&1").c_str());
  setenv("LOCPATH", dir.c_str(), 1);
  const bool set = std::setlocale(LC_NUMERIC, "de_DE.UTF-8") != nullptr;
  unsetenv("LOCPATH");
  std::filesystem::remove_all(dir);  // (the locale is loaded)
  return set;
}

}  // namespace

TEST_CASE("JSON numbers read and write the same whatever the locale's decimal point") {
  // LC_NUMERIC as it was, however the case ends (the next cases format and read numbers too)
  struct Restore {
    std::string was = std::setlocale(LC_NUMERIC, nullptr);
    ~Restore() { std::setlocale(LC_NUMERIC, was.c_str()); }
  } restore;
  if (!comma_decimal_locale())
    test::skip_case(
        "no locale with a decimal comma could be made: localedef needs glibc's locale sources, Debian's "
        "package locales (tools/setup test installs it)");
  CHECK(std::strtod("0.5", nullptr) == 0.0);  // the locale is in force: strtod stops at the '.'
  tandem::CheckpointManifest m;
  m.tensors = {{"w", 1, tandem::DType::fp32}};
  m.files = {{"f", 1, 1}};
  m.optimizer_groups = {{{"lr", 1e-3f}, {"beta2", 0.999f}}};
  const std::string text = tandem::detail::manifest_json(m);
  const tandem::CheckpointManifest back = tandem::detail::parse_manifest(text, "m");
  CHECK(text.find("\"lr\": 0.001, \"beta2\": 0.999") != std::string::npos);
  CHECK(static_cast<float>(back.optimizer_groups.at(0).at(0).second) == 1e-3f);
  CHECK(static_cast<float>(back.optimizer_groups.at(0).at(1).second) == 0.999f);
}

TEST_CASE("json::number writes the shortest text that reads back as the number, or as its float") {
  using tandem::detail::json::number;
  using tandem::detail::json::number_value;
  CHECK(number(3.4028234663852886e38) == "3.4028235e+38");  // FLT_MAX: its text reads back above it, as FLT_MAX
  float f = 0;
  CHECK((tandem::detail::json::float_of(number_value("3.4028235e+38"), f) && f == FLT_MAX));
  CHECK(!tandem::detail::json::float_of(3.4028235677973366e38, f));  // halfway to 2^128: infinity
  // beyond a double's range: +-infinity or +-0, by the magnitude the text writes
  CHECK(number_value("1e400") == HUGE_VAL);
  CHECK(number_value("-1000e306") == -HUGE_VAL);
  CHECK(number_value("0.00001e-320") == 0.0);
  CHECK(std::signbit(number_value("-1e-400")));
  CHECK(number_value("123456789e-400") == 0.0);
  CHECK(number_value("0.0000123e315") == HUGE_VAL);
  CHECK(number(1e-3f) == "0.001");
  CHECK(number(0.9f) == "0.9");
  CHECK(number(1e-8f) == "1e-08");
  CHECK(number(0.0) == "0");
  CHECK(number(0.1) == "0.1");  // a double that is no float's value: its own shortest text
  CHECK(number(1.0 / 3.0) == "0.3333333333333333");
  std::mt19937 gen(5);
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t bits = gen();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    if (!std::isfinite(f)) continue;
    const std::string text = number(f);
    // JSON's grammar: the parser reads it as a number
    tandem::detail::json::Parser p(text, "n");
    const double read = p.value(0).number;
    REQUIRE_MESSAGE(static_cast<float>(read) == f, text);
    std::uint64_t d = (static_cast<std::uint64_t>(gen()) << 32) | gen();
    double x;
    std::memcpy(&x, &d, sizeof x);
    if (std::isfinite(x)) REQUIRE_MESSAGE(std::strtod(number(x).c_str(), nullptr) == x, number(x));
  }
}
