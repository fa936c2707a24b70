// The demo's Thrift service (`thrift-sidecar demo`, `demo-upstream`, `demo-client`).
//
// Its Python code is generated once and committed under proxy/demo_gen/ (the only generated
// code in the repository), so the demo runs from an installed package without the compiler.
// After changing this file, regenerate it (see proxy/demo_gen/__init__.py):
//   thrift --gen py -out /tmp/gen proxy/data/user_service.thrift
//   cp /tmp/gen/user_service/{constants,ttypes,UserService}.py proxy/demo_gen/user_service/
namespace py user_service
namespace go userservice

struct User {
  1: i64 id,
  2: string username,
  3: string email,
  4: string first_name,
  5: string last_name,
  6: bool is_staff,
  7: i64 date_joined,            // seconds since the epoch
  8: map<string, string> attrs,  // team, timezone, locale, ...
}

// The upstream is temporarily unable to answer; safe to retry elsewhere.
exception Unavailable {
  1: string reason,
}

service UserService {
  // Cheap liveness check (the sidecar's health check calls it).
  void ping(),
  // `count` users (ids from 1), after sleeping `sleep_ms` milliseconds. The demo's large call
  // asks for 5,499 of them: about 1 MB on the wire.
  list<User> get_users(1: i32 count, 2: i32 sleep_ms) throws (1: Unavailable unavailable),
}
