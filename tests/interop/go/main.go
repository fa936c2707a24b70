// Command sidecar-test-client is a real Apache Thrift Go client (library
// v0.22, code generated from tests/idl/sidecar_test.thrift) that the Python
// tests run against the proxy, to check interop with a second language.
//
// Usage:
//
//	sidecar-test-client -addr 127.0.0.1:9090 -transport framed|buffered|header \
//	    -protocol binary|compact -scenario basic|oneway_then_call|ping_loop|errors \
//	    [-multiplex] [-count N] [-timeout 10s]
//
// It prints one JSON object per line on stdout for each call:
//
//	{"call": "ping", "ok": true, "result": null, "error_type": null,
//	 "app_error_type": null, "message": null, "conn": 1, "ms": 0.21}
//
// "ok" says the call ended as the scenario expects: for most calls that is
// success, for lookup("missing") / lookup("down") in "basic" it is the declared
// exception (the line then has "expected" and "error_type" set). error_type is
// "TApplicationException" (with app_error_type = TypeId()), "NotFound",
// "Unavailable", "TTransportException" (with transport_error_type),
// "TProtocolException", "CheckFailed" (the call returned but the value is
// wrong), or the Go type of any other error. "message" is the error text
// (NotFound.what, Unavailable.reason). Optional keys: "expected", "iter"
// (ping_loop), "wire_message_type" (log_event: the message type byte the
// client wrote on the wire), "transport_error_type", "conn" (1-based
// connection number, ping_loop reconnects) and "ms".
//
// Exit status: 0 when the scenario ran as expected (TApplicationExceptions are
// expected outcomes in ping_loop and errors); 1 when something unexpected
// happened (a line with ok=false in basic or oneway_then_call, a transport or
// protocol failure other than the one reconnect ping_loop allows, a failed
// connect); 2 on bad flags.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/apache/thrift/lib/go/thrift"

	"sidecarclient/gen-go/sidecartest"
)

type options struct {
	addr, transport, protocol, scenario string
	multiplex                           bool
	count, echoSize                     int
	timeout                             time.Duration
}

// line is one JSON output line; the first six keys are always present (null
// when they do not apply).
type line struct {
	Call               string  `json:"call"`
	OK                 bool    `json:"ok"`
	Result             any     `json:"result"`
	ErrorType          *string `json:"error_type"`
	AppErrorType       *int32  `json:"app_error_type"`
	Message            *string `json:"message"`
	Expected           string  `json:"expected,omitempty"`
	Iter               int     `json:"iter,omitempty"`
	WireMessageType    *int    `json:"wire_message_type,omitempty"`
	TransportErrorType *int    `json:"transport_error_type,omitempty"`
	Conn               int     `json:"conn"`
	Ms                 float64 `json:"ms"`
	broken             bool    // the connection is no longer usable
}

// checkError is returned by a call's closure when the call itself succeeded
// but the value it returned is not the expected one.
type checkError struct{ msg string }

func (e *checkError) Error() string { return e.msg }

func checkf(format string, a ...any) error { return &checkError{fmt.Sprintf(format, a...)} }

// recConn records the bytes written while recording is on, so that the
// message type the Thrift client put on the wire can be reported.
type recConn struct {
	net.Conn
	recording bool
	out       []byte
}

func (c *recConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if c.recording && n > 0 {
		c.out = append(c.out, b[:n]...)
	}
	return n, err
}

// conn is one client connection with a client per service.
type conn struct {
	rec   *recConn
	trans thrift.TTransport
	test  *sidecartest.TestServiceClient
	admin *sidecartest.AdminServiceClient // nil unless -multiplex
}

func (c *conn) close() { _ = c.trans.Close() }

// bufSize is the buffer under the framed transport, so that a frame's length
// and body leave in one write.
const bufSize = 64 * 1024

func dial(o *options) (*conn, error) {
	cfg := &thrift.TConfiguration{
		MaxFrameSize:   256 << 20,
		MaxMessageSize: 256 << 20,
		ConnectTimeout: o.timeout,
		SocketTimeout:  o.timeout,
	}
	pid := thrift.THeaderProtocolBinary
	if o.protocol == "compact" {
		pid = thrift.THeaderProtocolCompact
	}
	cfg.THeaderProtocolID = &pid

	d := net.Dialer{Timeout: o.timeout}
	nc, err := d.Dial("tcp", o.addr)
	if err != nil {
		return nil, err
	}
	rc := &recConn{Conn: nc}
	sock := thrift.NewTSocketFromConnConf(rc, cfg)

	var trans thrift.TTransport
	var proto thrift.TProtocol
	switch o.transport {
	case "framed":
		trans = thrift.NewTFramedTransportConf(thrift.NewTBufferedTransport(sock, bufSize), cfg)
	case "buffered":
		trans = thrift.NewTBufferedTransport(sock, bufSize)
	case "header":
		hp := thrift.NewTHeaderProtocolConf(sock, cfg) // wraps sock in a THeaderTransport
		trans, proto = hp.Transport(), hp
	}
	if proto == nil {
		if o.protocol == "compact" {
			proto = thrift.NewTCompactProtocolConf(trans, cfg)
		} else {
			proto = thrift.NewTBinaryProtocolConf(trans, cfg)
		}
	}

	c := &conn{rec: rc, trans: trans}
	if o.multiplex {
		c.test = sidecartest.NewTestServiceClient(
			thrift.NewTStandardClient(proto, thrift.NewTMultiplexedProtocol(proto, "TestService")))
		c.admin = sidecartest.NewAdminServiceClient(
			thrift.NewTStandardClient(proto, thrift.NewTMultiplexedProtocol(proto, "AdminService")))
	} else {
		c.test = sidecartest.NewTestServiceClient(thrift.NewTStandardClient(proto, proto))
	}
	return c, nil
}

type runner struct {
	o          *options
	c          *conn
	connNo     int
	out        *json.Encoder
	strict     bool // every call must end as expected (basic, oneway_then_call)
	dead       bool // a call broke the connection: later calls are skipped
	unexpected bool
}

func strp(s string) *string { return &s }

// classify maps an error onto the line's error fields; broken tells whether
// the connection can no longer be used.
func classify(err error, l *line) {
	var (
		nf *sidecartest.NotFound
		un *sidecartest.Unavailable
		ce *checkError
		ae thrift.TApplicationException
		te thrift.TTransportException
		pe thrift.TProtocolException
		ne net.Error
	)
	switch {
	case errors.As(err, &nf):
		l.ErrorType, l.Message = strp("NotFound"), strp(nf.What)
	case errors.As(err, &un):
		l.ErrorType, l.Message = strp("Unavailable"), strp(un.Reason)
	case errors.As(err, &ce):
		l.ErrorType, l.Message = strp("CheckFailed"), strp(ce.msg)
	case errors.As(err, &ae):
		t := ae.TypeId()
		l.ErrorType, l.AppErrorType, l.Message = strp("TApplicationException"), &t, strp(ae.Error())
		// The Go client raises these itself after reading only the message
		// header of a reply it cannot match: the rest is unread, the stream
		// out of step.
		for _, suffix := range []string{": wrong method name", ": out of order sequence response", ": invalid message type"} {
			if strings.HasSuffix(ae.Error(), suffix) {
				l.broken = true
			}
		}
	case errors.As(err, &te):
		t := te.TypeId()
		l.ErrorType, l.TransportErrorType, l.Message = strp("TTransportException"), &t, strp(err.Error())
		l.broken = true
	case errors.As(err, &pe):
		l.ErrorType, l.Message = strp("TProtocolException"), strp(err.Error())
		l.broken = true
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.As(err, &ne):
		l.ErrorType, l.Message = strp("TTransportException"), strp(err.Error())
		l.broken = true
	default:
		l.ErrorType, l.Message = strp(fmt.Sprintf("%T", err)), strp(err.Error())
		l.broken = true
	}
}

func (r *runner) emit(l *line) {
	if err := r.out.Encode(l); err != nil {
		fmt.Fprintf(os.Stderr, "writing stdout: %v\n", err)
		os.Exit(1)
	}
}

// do runs one call and prints its line. expect is "" when the call must
// succeed, else the error_type it must end with; decorate, if any, adds to
// the line before it is printed.
func (r *runner) do(name, expect string, fn func(ctx context.Context) (any, error), decorate ...func(*line)) *line {
	l := &line{Call: name, Expected: expect, Conn: r.connNo}
	if r.dead {
		l.ErrorType, l.Message = strp("Skipped"), strp("the connection was broken by an earlier call")
		l.broken = true
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), r.o.timeout)
		start := time.Now()
		res, err := fn(ctx)
		cancel()
		l.Ms = math.Round(float64(time.Since(start).Microseconds())) / 1000
		l.Result = res
		if err != nil {
			classify(err, l)
		}
		if expect == "" {
			l.OK = err == nil
		} else {
			l.OK = l.ErrorType != nil && *l.ErrorType == expect
		}
	}
	for _, d := range decorate {
		d(l)
	}
	if l.broken {
		r.dead = true
	}
	if !l.OK && r.strict {
		r.unexpected = true
	}
	r.emit(l)
	return l
}

func (r *runner) connect() bool {
	c, err := dial(r.o)
	r.connNo++
	if err != nil {
		l := &line{Call: "connect", Conn: r.connNo}
		classify(err, l)
		r.emit(l)
		r.unexpected = true
		return false
	}
	r.c = c
	return true
}

// --- scenarios -------------------------------------------------------------

func (r *runner) basic() {
	t := r.c.test
	r.do("ping", "", func(ctx context.Context) (any, error) { return nil, t.Ping(ctx) })

	if r.c.admin != nil {
		a := r.c.admin
		r.do("add", "", func(ctx context.Context) (any, error) {
			v, err := a.Add(ctx, 2, 3)
			if err == nil && v != 5 {
				err = checkf("add(2,3) = %d, want 5", v)
			}
			return v, err
		})
	}

	r.do("roundtrip", "", func(ctx context.Context) (any, error) {
		sent := everything()
		got, err := t.Roundtrip(ctx, sent)
		if err != nil {
			return nil, err
		}
		if diffs := diffEverything(everything(), got); len(diffs) > 0 {
			return false, checkf("roundtrip changed fields: %s", strings.Join(diffs, ", "))
		}
		return true, nil
	})

	r.do("echo", "", func(ctx context.Context) (any, error) {
		payload := make([]byte, r.o.echoSize)
		for i := range payload {
			payload[i] = byte(i*31 + 7)
		}
		got, err := t.Echo(ctx, payload)
		if err != nil {
			return nil, err
		}
		if !bytes.Equal(got, payload) {
			return len(got), checkf("echo returned %d bytes, not the %d sent", len(got), len(payload))
		}
		return len(got), nil
	})

	r.do("get_users", "", func(ctx context.Context) (any, error) {
		users, err := t.GetUsers(ctx, 100, 0)
		if err != nil {
			return nil, err
		}
		if len(users) != 100 {
			return len(users), checkf("get_users(100, 0) returned %d users", len(users))
		}
		for i, u := range users {
			if u == nil {
				return len(users), checkf("get_users: user %d is nil", i)
			}
		}
		return len(users), nil
	})

	lookup := func(key string) func(ctx context.Context) (any, error) {
		return func(ctx context.Context) (any, error) {
			s, err := t.Lookup(ctx, key)
			if err != nil {
				return nil, err
			}
			return s, nil
		}
	}
	r.do("lookup(missing)", "NotFound", lookup("missing"))
	r.do("lookup(down)", "Unavailable", lookup("down"))
	r.do("lookup(x)", "", lookup("x"))
}

func (r *runner) onewayThenCall() {
	t := r.c.test
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	event := "go-oneway-" + hex.EncodeToString(rnd[:])

	rec := r.c.rec
	r.do("log_event", "", func(ctx context.Context) (any, error) {
		rec.out, rec.recording = rec.out[:0], true
		defer func() { rec.recording = false }()
		return event, t.LogEvent(ctx, event)
	}, func(l *line) {
		if mt, ok := wireMessageType(rec.out); ok {
			l.WireMessageType = &mt // 1 = CALL, 4 = ONEWAY
		}
	})

	r.do("ping", "", func(ctx context.Context) (any, error) { return nil, t.Ping(ctx) })
	r.do("count", "", func(ctx context.Context) (any, error) { return t.Count(ctx, event) })
}

func (r *runner) pingLoop() {
	reconnected := false
	for i := 1; i <= r.o.count; i++ {
		t := r.c.test
		l := r.do("ping", "", func(ctx context.Context) (any, error) { return nil, t.Ping(ctx) },
			func(l *line) { l.Iter = i })
		if !l.broken {
			continue
		}
		r.c.close()
		if reconnected {
			r.unexpected = true
			return
		}
		reconnected = true
		if !r.connect() {
			return
		}
		r.dead = false
		r.emit(&line{Call: "reconnect", OK: true, Conn: r.connNo})
	}
}

func (r *runner) errorsScenario() {
	t := r.c.test
	l := r.do("ping", "", func(ctx context.Context) (any, error) { return nil, t.Ping(ctx) })
	if l.broken {
		r.unexpected = true
	}
}

// --- helpers ---------------------------------------------------------------

// wireMessageType finds the message type byte of the first message in b,
// which holds what the client wrote: unframed binary/compact, framed (4-byte
// length first) or a THeader frame (payload after the header, no transforms).
func wireMessageType(b []byte) (int, bool) {
	if len(b) >= 1 && b[0] != 0x80 && b[0] != 0x82 {
		if len(b) >= 14 && b[4] == 0x0f && b[5] == 0xff {
			off := 14 + int(binary.BigEndian.Uint16(b[12:14]))*4
			if off > len(b) {
				return 0, false
			}
			b = b[off:]
		} else if len(b) >= 4 {
			b = b[4:]
		}
	}
	switch {
	case len(b) >= 4 && b[0] == 0x80 && b[1] == 0x01: // strict binary: 0x8001 0x00 type
		return int(b[3] & 0x07), true
	case len(b) >= 2 && b[0] == 0x82: // compact: 0x82, type<<5 | version
		return int(b[1]>>5) & 0x07, true
	}
	return 0, false
}

func everything() *sidecartest.Everything {
	bin := make([]byte, 256)
	for i := range bin {
		bin[i] = byte(i)
	}
	return &sidecartest.Everything{
		B:    true,
		I8v:  math.MinInt8,
		I16v: math.MinInt16,
		I32v: math.MinInt32,
		I64v: math.MinInt64,
		D:    -1.5e-300,
		S:    "héllo, wörld ✓ 日本語 \x00 tab\t end",
		Bin:  bin,
		Strs: []string{"", "a", "ünïcödé", strings.Repeat("x", 1000)},
		Ints: []int32{math.MinInt32, -1, 0, 1, 42, math.MaxInt32},
		Inners: map[string]*sidecartest.Inner{
			"":    {N: 0, Label: ""},
			"one": {N: 1, Label: "uno", Values: []int64{1, 2, 3}},
			"max": {N: math.MaxInt32, Label: "max", Values: []int64{math.MinInt64, math.MaxInt64}},
		},
		Inner:  &sidecartest.Inner{N: -7, Label: "inner", Values: []int64{}},
		Color:  sidecartest.Color_BLUE,
		Nested: [][]int32{{}, {1}, {2, 3}, {math.MinInt32, math.MaxInt32}},
		Maybe:  &sidecartest.Inner{N: 15, Label: "maybe", Values: []int64{15}},
		Deep: map[int64][]*sidecartest.Inner{
			math.MinInt64: {{N: 1, Label: "a"}},
			0:             {},
			math.MaxInt64: {{N: 2, Label: "b", Values: []int64{-1}}, {N: 3, Label: "c"}},
		},
		Doubles: []float64{0, math.Copysign(0, -1), 1.5, -2.25, math.Pi, math.MaxFloat64,
			math.SmallestNonzeroFloat64, math.Inf(1), math.Inf(-1), math.NaN()},
		Tags: []string{"alpha", "beta", "gamma", "δέλτα"},
	}
}

// diffEverything names the fields of got that differ from want. Sets compare
// without order, doubles bit for bit (so -0.0 and NaN must survive), the rest
// with the generated Equals.
func diffEverything(want, got *sidecartest.Everything) []string {
	if got == nil {
		return []string{"<nil result>"}
	}
	w, g := *want, *got
	var diffs []string
	sameBits := func(a, b []float64) bool {
		return slices.EqualFunc(a, b, func(x, y float64) bool { return math.Float64bits(x) == math.Float64bits(y) })
	}
	if !sameBits([]float64{w.D}, []float64{g.D}) {
		diffs = append(diffs, "D")
	}
	if !sameBits(w.Doubles, g.Doubles) {
		diffs = append(diffs, "Doubles")
	}
	w.D, g.D, w.Doubles, g.Doubles = 0, 0, nil, nil
	w.Ints, g.Ints = slices.Sorted(slices.Values(w.Ints)), slices.Sorted(slices.Values(g.Ints))
	w.Tags, g.Tags = slices.Sorted(slices.Values(w.Tags)), slices.Sorted(slices.Values(g.Tags))

	wv, gv := reflect.ValueOf(&w).Elem(), reflect.ValueOf(&g).Elem()
	for i := 0; i < wv.NumField(); i++ {
		a, b := &sidecartest.Everything{}, &sidecartest.Everything{}
		reflect.ValueOf(a).Elem().Field(i).Set(wv.Field(i))
		reflect.ValueOf(b).Elem().Field(i).Set(gv.Field(i))
		if !a.Equals(b) {
			diffs = append(diffs, wv.Type().Field(i).Name)
		}
	}
	if (w.Maybe != nil) != g.IsSetMaybe() {
		diffs = append(diffs, "Maybe(isset)")
	}
	return diffs
}

func main() {
	o := &options{}
	flag.StringVar(&o.addr, "addr", "127.0.0.1:9090", "host:port to connect to")
	flag.StringVar(&o.transport, "transport", "framed", "framed|buffered|header")
	flag.StringVar(&o.protocol, "protocol", "binary", "binary|compact")
	flag.StringVar(&o.scenario, "scenario", "basic", "basic|oneway_then_call|ping_loop|errors")
	flag.BoolVar(&o.multiplex, "multiplex", false, `use TMultiplexedProtocol ("TestService", "AdminService")`)
	flag.IntVar(&o.count, "count", 10, "pings for -scenario ping_loop")
	flag.IntVar(&o.echoSize, "echo-size", 100*1024, "bytes echoed by -scenario basic")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Second, "connect timeout and per-call/socket timeout")
	flag.Parse()

	usage := func(format string, a ...any) {
		fmt.Fprintf(os.Stderr, format+"\n", a...)
		flag.Usage()
		os.Exit(2)
	}
	if flag.NArg() > 0 {
		usage("unexpected arguments: %v", flag.Args())
	}
	if !slices.Contains([]string{"framed", "buffered", "header"}, o.transport) {
		usage("bad -transport %q", o.transport)
	}
	if !slices.Contains([]string{"binary", "compact"}, o.protocol) {
		usage("bad -protocol %q", o.protocol)
	}
	strict := o.scenario == "basic" || o.scenario == "oneway_then_call"
	scenarios := map[string]func(*runner){
		"basic":            (*runner).basic,
		"oneway_then_call": (*runner).onewayThenCall,
		"ping_loop":        (*runner).pingLoop,
		"errors":           (*runner).errorsScenario,
	}
	scenario, ok := scenarios[o.scenario]
	if !ok {
		usage("bad -scenario %q", o.scenario)
	}
	if o.echoSize < 0 {
		usage("bad -echo-size %d", o.echoSize)
	}
	if o.count < 0 {
		usage("bad -count %d", o.count)
	}

	r := &runner{o: o, out: json.NewEncoder(os.Stdout), strict: strict}
	r.out.SetEscapeHTML(false)
	if !r.connect() {
		os.Exit(1)
	}
	scenario(r)
	r.c.close()
	os.Exit(r.exitCode())
}

// exitCode is 1 when something unexpected happened (see the package doc).
func (r *runner) exitCode() int {
	if r.unexpected {
		return 1
	}
	return 0
}
