// SPDX-License-Identifier: Apache-2.0
// The JSON tandem reads and writes: safetensors headers and checkpoint manifests. A small strict parser (RFC 8259:
// UTF-8 text; objects, arrays, strings with every escape, numbers, true/false/null; nesting at most 64 deep), which
// keeps non-negative integers exact up to 2^64 - 1 (byte offsets), and a string quoter for writing. Any malformed input
// is a tandem::error naming the byte where it went wrong.
#pragma once

#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail::json {

struct Member;

struct Value {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  double number = 0.0;
  bool is_count = false;    ///< a non-negative integer, exact in `count`
  std::uint64_t count = 0;  ///< (is_count)
  std::string string;
  std::vector<Value> items;     ///< (array)
  std::vector<Member> members;  ///< (object), in the text's order

  /// The member named `key` of an object, or null.
  const Value* find(std::string_view key) const;
};

/// One member of an object: its name and value.
struct Member {
  std::string name;
  Value value;
};

inline const Value* Value::find(std::string_view key) const {
  for (const Member& m : members)
    if (m.name == key) return &m.value;
  return nullptr;
}

/// The value of a JSON number's text (-?int frac? exp?, which the caller has checked): the nearest double, whatever the
/// C locale's decimal point (std::from_chars, not strtod); beyond a double's range, +-infinity where it overflows and
/// +-0 where it underflows.
inline double number_value(std::string_view text) {
  double v = 0.0;
  const char* const end = text.data() + text.size();
  const auto read = std::from_chars(text.data(), end, v);
  if (read.ec == std::errc{} && read.ptr == end) return v;
  if (read.ec != std::errc::result_out_of_range)
    fail("tandem: internal error: `" + std::string(text) + "` is no number");
  // Out of range: the decimal exponent of its first nonzero digit says which way.
  const bool negative = text.front() == '-';
  long long lead = 0;  // that exponent
  bool seen = false;   // a nonzero digit
  std::size_t i = negative ? 1 : 0;
  auto digit = [&] { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  for (; digit(); ++i) lead += seen ? 1 : 0, seen = seen || text[i] != '0';
  if (i < text.size() && text[i] == '.')
    for (++i; digit(); ++i)
      if (!seen) --lead, seen = text[i] != '0';
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    const bool down = ++i < text.size() && text[i] == '-';
    if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
    long long e = 0;
    for (; digit(); ++i) e = e < 1000000000 ? 10 * e + (text[i] - '0') : e;
    lead += down ? -e : e;
  }
  const double magnitude = lead > 0 ? HUGE_VAL : 0.0;
  return negative ? -magnitude : magnitude;
}

/// v as a float, where it rounds to a finite one (to +-FLT_MAX up to halfway to the next power of two, as
/// round-to-nearest does, where a cast would be undefined): false where it is NaN or rounds to infinity.
inline bool float_of(double v, float& out) {
  constexpr double limit = 0x1.ffffffp+127;  // halfway between FLT_MAX and 2^128: from here on, infinity
  if (!(v > -limit && v < limit)) return false;
  out = v > static_cast<double>(FLT_MAX)    ? FLT_MAX
        : v < -static_cast<double>(FLT_MAX) ? -FLT_MAX
                                            : static_cast<float>(v);
  return true;
}

/// A finite number as JSON text, the shortest that reads back as v (number_value); where v is a float's value, the
/// shortest that reads back as that float (float_of): 0.001f as 0.001, not 0.0010000000474974513.
inline std::string number(double v) {
  char text[32];
  if (float f; float_of(v, f) && static_cast<double>(f) == v) {
    const std::string shortest(text, std::to_chars(text, text + sizeof text, f).ptr);
    if (float back; float_of(number_value(shortest), back) && back == f) return shortest;
  }
  return std::string(text, std::to_chars(text, text + sizeof text, v).ptr);
}

/// Appends s to out with the escapes a JSON string literal requires (no quotes).
inline void escape_into(std::string& out, std::string_view s) {
  std::size_t plain = 0;  // the start of a run that needs no escape, appended whole
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(s.substr(plain, i - plain));
    plain = i + 1;
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default: {
        static const char hex[] = "0123456789abcdef";
        out += "\\u00";
        out += hex[c >> 4];
        out += hex[c & 0xf];
      }
    }
  }
  out.append(s.substr(plain));
}

/// Appends the JSON string literal of s (quoted, with the escapes JSON requires) to out.
inline void quote_into(std::string& out, std::string_view s) {
  out += '"';
  escape_into(out, s);
  out += '"';
}

/// The JSON string literal of s.
inline std::string quote(std::string_view s) {
  std::string out;
  quote_into(out, s);
  return out;
}

/// The length of the longest prefix of `s` that is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates,
/// nothing past U+10FFFF): s.size() where all of it is.
inline std::size_t utf8_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    for (std::uint64_t w; i + 8 <= n; i += 8) {  // ASCII, 8 bytes at a time
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) != 0) break;
    }
    if (i == n) break;
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range (narrower after E0, ED, F0, F4)
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // not overlong
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // not overlong
      if (c == 0xF4) hi = 0x8F;  // not past U+10FFFF
    } else {
      return i;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return n;
}

/// A cursor over JSON text. document() parses it whole into a Value; a reader that knows what it expects (a safetensors
/// header of tens of thousands of entries) walks it instead, member by member, building nothing it does not keep:
///   p.object([&](std::string_view name) { ... consume the member's value: p.string(), p.number(), p.object(...) });
class Parser {
 public:
  /// Throws at once where `text` is not UTF-8 (as RFC 8259 asks, and the reference safetensors reader checks).
  Parser(std::string_view text, std::string what) : text_(text), what_(std::move(what)) {
    at_ = utf8_prefix(text);
    if (at_ != text.size()) bad("a byte that is not part of UTF-8");
    at_ = 0;
  }

  Value document() {
    Value v = value(0);
    finish();
    return v;
  }

  /// After the last value: only white space may follow.
  void finish() {
    space();
    if (at_ != text_.size()) bad("extra characters after the value");
  }

  /// The next character after white space ('\0' at the end), not consumed.
  char next() {
    space();
    return peek();
  }

  /// The object at the cursor: member(name) for each member in order (`name` a std::string_view valid during the
  /// call), which consumes the member's value.
  template <class Member>
  void object(Member&& member) {
    space();
    expect('{');
    if (next() == '}') {
      ++at_;
      return;
    }
    std::string scratch;
    for (;;) {
      if (next() != '"') bad("expected a member name");
      const std::string_view name = text(scratch);
      space();
      expect(':');
      member(name);
      if (next() == ',') {
        ++at_;
        continue;
      }
      expect('}');
      return;
    }
  }

  /// The array at the cursor: item() for each item in order, which consumes it.
  template <class Item>
  void array(Item&& item) {
    space();
    expect('[');
    if (next() == ']') {
      ++at_;
      return;
    }
    for (;;) {
      item();
      if (next() == ',') {
        ++at_;
        continue;
      }
      expect(']');
      return;
    }
  }

  /// Any value, whole; `depth` is how deep the cursor already is (at most 64 in all).
  Value value(int depth) {
    if (depth > 64) bad("nested more than 64 deep");
    Value v;
    switch (next()) {
      case '{':
        v.kind = Value::Kind::object;
        object([&](std::string_view name) { v.members.push_back({std::string(name), value(depth + 1)}); });
        return v;
      case '[':
        v.kind = Value::Kind::array;
        array([&] { v.items.push_back(value(depth + 1)); });
        return v;
      case '"':
        v.kind = Value::Kind::string;
        v.string = string();
        return v;
      case 't':
        literal("true");
        v.kind = Value::Kind::boolean;
        v.boolean = true;
        return v;
      case 'f':
        literal("false");
        v.kind = Value::Kind::boolean;
        return v;
      case 'n':
        literal("null");
        return v;
      default:
        return number();
    }
  }

  /// The string at the cursor (after white space), unescaped.
  std::string string() {
    std::string s;
    const std::string_view v = text(s);
    return v.data() == s.data() ? s : std::string(v);
  }

  /// The string at the cursor (after white space), unescaped: a view of the JSON text where it has no escape (most
  /// strings), else of `s`, which holds it unescaped.
  std::string_view text(std::string& s) {
    space();
    expect('"');
    const std::size_t begin = at_;
    // The closing quote found by memchr; unless an escape or a control character comes before it, that is the string.
    if (const void* quote = std::memchr(text_.data() + at_, '"', text_.size() - at_)) {
      const auto end = static_cast<std::size_t>(static_cast<const char*>(quote) - text_.data());
      bool plain = true;
      for (std::size_t i = at_; i < end; ++i) {
        const auto c = static_cast<unsigned char>(text_[i]);
        plain &= c != '\\' && c >= 0x20;
      }
      if (plain) {
        at_ = end + 1;
        return text_.substr(begin, end - begin);
      }
    }
    s.clear();
    for (;;) {
      if (at_ >= text_.size()) bad("unterminated string");
      const auto c = static_cast<unsigned char>(text_[at_++]);
      if (c == '"') return s;
      if (c < 0x20) bad("a control character in a string");
      if (c != '\\') {
        s += static_cast<char>(c);
        continue;
      }
      const char e = peek();
      ++at_;
      switch (e) {
        case '"':
        case '\\':
        case '/':
          s += e;
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case 'n':
          s += '\n';
          break;
        case 'r':
          s += '\r';
          break;
        case 't':
          s += '\t';
          break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            if (peek() != '\\' || at_ + 1 >= text_.size() || text_[at_ + 1] != 'u') bad("a lone high surrogate");
            at_ += 2;
            const std::uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) bad("a high surrogate without its low one");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            bad("a lone low surrogate");
          }
          utf8(cp, s);
          break;
        }
        default:
          bad("an unknown escape");
      }
    }
  }

  /// The number at the cursor (after white space).
  Value number() {
    Value v;
    v.kind = Value::Kind::number;
    v.number = scan_number(v.is_count, v.count);
    return v;
  }

  /// The value at the cursor (`depth` deep): a non-negative integer below 2^64 goes to `out` (true); any other value
  /// is read whole and dropped (false).
  bool count(std::uint64_t& out, int depth) {
    const char c = next();
    if (c < '0' || c > '9') {
      (void)value(depth);
      return false;
    }
    bool is_count = false;
    (void)scan_number(is_count, out);
    return is_count;
  }

  /// Where the cursor is, for rewind(): a reader may try a form it expects and go back if the text has another.
  std::size_t position() const { return at_; }
  void rewind(std::size_t at) { at_ = at; }

  /// Consumes `s` if the text at the cursor is exactly `s` (no white space skipped).
  bool take(std::string_view s) {
    if (text_.size() - at_ < s.size() || std::memcmp(text_.data() + at_, s.data(), s.size()) != 0) return false;
    at_ += s.size();
    return true;
  }

  /// take() of a literal: its length is known where it is compiled, so the comparison is inlined (a reader matching
  /// tens of thousands of entries byte for byte calls this for each piece).
  template <std::size_t N>
  bool take(const char (&s)[N]) {
    if (text_.size() - at_ < N - 1 || std::memcmp(text_.data() + at_, s, N - 1) != 0) return false;
    at_ += N - 1;
    return true;
  }

  /// Consumes a non-negative integer of at most 19 digits written as JSON writes it (no leading zero) at the cursor,
  /// into `out`; leaves the cursor where it was at anything else (false). A '.' or an exponent after the digits is
  /// not looked at: the caller's next take() fails there.
  bool take_count(std::uint64_t& out) {
    std::size_t i = at_;
    std::uint64_t n = 0;
    while (i < text_.size() && i - at_ < 19 && text_[i] >= '0' && text_[i] <= '9')
      n = n * 10 + static_cast<std::uint64_t>(text_[i++] - '0');
    const std::size_t digits = i - at_;
    if (digits == 0 || (digits > 1 && text_[at_] == '0') || (i < text_.size() && text_[i] >= '0' && text_[i] <= '9'))
      return false;
    at_ = i;
    out = n;
    return true;
  }

  /// Fails naming the byte at the cursor.
  [[noreturn]] void bad(const std::string& why) const {
    fail("tandem: " + what_ + " is not valid JSON: " + why + " (at byte " + std::to_string(at_) + ")");
  }

 private:
  void space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t' || text_[at_] == '\n' || text_[at_] == '\r'))
      ++at_;
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void expect(char c) {
    if (peek() != c) bad(std::string("expected '") + c + "'");
    ++at_;
  }
  void literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) bad("unknown literal");
    at_ += word.size();
  }
  /// Scans the number at the cursor (after white space): its value; whether it is a non-negative integer below 2^64,
  /// and that integer, exact.
  double scan_number(bool& is_count, std::uint64_t& count) {
    space();
    const std::size_t begin = at_;
    if (peek() == '-') ++at_;
    if (peek() == '0') {
      ++at_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (peek() >= '0' && peek() <= '9') ++at_;
    } else {
      bad("expected a value");
    }
    bool integer = true;
    if (peek() == '.') {
      integer = false;
      ++at_;
      if (!(peek() >= '0' && peek() <= '9')) bad("expected a digit after '.'");
      while (peek() >= '0' && peek() <= '9') ++at_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integer = false;
      ++at_;
      if (peek() == '+' || peek() == '-') ++at_;
      if (!(peek() >= '0' && peek() <= '9')) bad("expected a digit in the exponent");
      while (peek() >= '0' && peek() <= '9') ++at_;
    }
    const std::string_view digits = text_.substr(begin, at_ - begin);
    is_count = false;
    count = 0;
    if (integer && digits[0] != '-') {
      std::uint64_t n = 0;
      bool exact = true;
      for (const char c : digits) {
        const auto d = static_cast<std::uint64_t>(c - '0');
        if (n > (UINT64_MAX - d) / 10) exact = false;
        n = n * 10 + d;
      }
      // (an integer below 2^64 converts as number_value rounds its decimal: to the nearest double)
      if (exact) {
        is_count = true;
        count = n;
        return static_cast<double>(n);
      }
    }
    return number_value(digits);  // out of range: +-HUGE_VAL or +-0 (never an exception)
  }

  std::uint32_t hex4() {
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = peek();
      ++at_;
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<std::uint32_t>(c - 'A' + 10);
      else
        bad("expected 4 hex digits after \\u");
    }
    return v;
  }

  static void utf8(std::uint32_t cp, std::string& s) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string_view text_;
  std::string what_;
  std::size_t at_ = 0;
};

/// Parses `text`; `what` names it in errors ("the manifest `dir/manifest.json`").
inline Value parse(std::string_view text, const std::string& what) { return Parser(text, what).document(); }

}  // namespace tandem::detail::json
