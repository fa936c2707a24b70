// Test IDL for thrift-sidecar: every base type, containers, nested structs,
// declared exceptions, oneway, and a second service for multiplexing.
namespace py sidecar_test
namespace go sidecartest

enum Color {
  RED = 1,
  GREEN = 2,
  BLUE = 3,
}

struct Inner {
  1: i32 n,
  2: string label,
  3: optional list<i64> values,
}

struct Everything {
  1: bool b,
  2: i8 i8v,
  3: i16 i16v,
  4: i32 i32v,
  5: i64 i64v,
  6: double d,
  7: string s,
  8: binary bin,
  9: list<string> strs,
  10: set<i32> ints,
  11: map<string, Inner> inners,
  12: Inner inner,
  13: Color color,
  14: list<list<i32>> nested,
  15: optional Inner maybe,
  16: map<i64, list<Inner>> deep,
  17: list<double> doubles,
  18: set<string> tags,
}

struct User {
  1: i64 id,
  2: string username,
  3: string email,
  4: string first_name,
  5: string last_name,
  6: bool is_staff,
  7: i64 date_joined,
  8: map<string, string> attrs,
}

exception NotFound {
  1: string what,
  2: i32 code,
}

exception Unavailable {
  1: string reason,
}

service TestService {
  // Empty request and reply: per-call overhead.
  void ping(),
  // Returns its argument unchanged: every type on the wire both ways.
  Everything roundtrip(1: Everything e),
  // Bulk bytes both ways (15 MB tests).
  binary echo(1: binary payload),
  // `count` deterministic users after `sleep_ms`.
  list<User> get_users(1: i32 count, 2: i32 sleep_ms),
  // Declared exceptions: "missing" -> NotFound, "down" -> Unavailable.
  string lookup(1: string key) throws (1: NotFound nf, 2: Unavailable un),
  // Sleeps, then returns its argument.
  i32 sleep(1: i32 ms),
  // Oneway: the server records the event, nothing is replied.
  oneway void log_event(1: string event),
  // Counts calls per key on the server (at-most-once checks); returns the new count.
  i64 incr(1: string key),
  // How many times incr(key) ran, and how many log_event(event) arrived.
  i64 count(1: string key),
}

service AdminService {
  string version(),
  i32 add(1: i32 a, 2: i32 b),
}
