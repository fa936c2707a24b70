// Wrapper module that builds Jaeger v2 from the Go module proxy (see ../README.md).
//
// `go install github.com/jaegertracing/jaeger/cmd/jaeger@v1.76.0` is refused because
// Jaeger's go.mod has replace directives, so ../build.sh runs
// `go build github.com/jaegertracing/jaeger/cmd/jaeger` from inside this module,
// which requires Jaeger and repeats its replace lines.
//
// This module has no Go source on purpose: cmd/jaeger is a main package and cannot be
// imported, and a tools.go / `tool` directive would make Go demand Jaeger's whole
// dependency list here. Do not run `go mod tidy` (it would drop the requirement).
// go.sum is Jaeger's own go.sum plus Jaeger's two lines: several of its modules are
// not in the checksum database, so it must not be regenerated from scratch.
module thrift-sidecar/tools/jaeger/wrapper

go 1.24.6

// Jaeger v2.13.0 is published as Go module version v1.76.0.
require github.com/jaegertracing/jaeger v1.76.0

// Copied verbatim from jaeger@v1.76.0/go.mod.
replace github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0
