package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// hsBound only bounds how long a test may fail slowly; no test waits for
// it to pass.
const hsBound = 30 * time.Second

// hsConfig has timeouts no test outlives, so that only the limit (or the
// one timeout a test shortens) can close a connection. A quarter of the
// limit is kept for probes, as an eighth is by default.
func hsConfig(limit int) httpServerConfig {
	return httpServerConfig{
		ReadHeaderTimeout: time.Hour,
		ReadTimeout:       time.Hour,
		WriteTimeout:      time.Hour,
		IdleTimeout:       time.Hour,
		MaxHeaderBytes:    16 << 10,
		MaxBodyBytes:      1 << 20,
		MaxConns:          limit,
		ProbeReserve:      limit / 4,
		ProbePaths:        []string{"/healthz", "/readyz"},
	}
}

// hsEndpoints serves /healthz like the agent does, and endpoints that
// report what their handlers saw.
type hsEndpoints struct {
	uploadErrs chan error    // /upload: each body read's outcome
	entered    chan struct{} // /block, /metrics: a handler has started...
	release    chan struct{} // ...and waits for a token here
	floodErrs  chan error    // /flood: the write error that stopped it
}

func newHSEndpoints() *hsEndpoints {
	return &hsEndpoints{
		uploadErrs: make(chan error, 100),
		entered:    make(chan struct{}, 1000),
		release:    make(chan struct{}),
		floodErrs:  make(chan error, 100),
	}
}

func (e *hsEndpoints) handler() http.Handler {
	mux := http.NewServeMux()
	ok := func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") }
	mux.HandleFunc("GET /healthz", ok)
	mux.HandleFunc("GET /readyz", ok)
	mux.HandleFunc("POST /upload", func(w http.ResponseWriter, r *http.Request) {
		_, err := io.ReadAll(r.Body)
		select {
		case e.uploadErrs <- err:
		default:
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
		}
	})
	block := func(w http.ResponseWriter, r *http.Request) {
		e.entered <- struct{}{}
		select {
		case <-e.release:
		case <-r.Context().Done():
		}
	}
	mux.HandleFunc("GET /block", block)
	// A scrape the test holds, as a slow one would hold its connection.
	mux.HandleFunc("GET /metrics", block)
	mux.HandleFunc("GET /flood", func(w http.ResponseWriter, _ *http.Request) {
		chunk := make([]byte, 64<<10)
		for {
			if _, err := w.Write(chunk); err != nil {
				e.floodErrs <- err
				return
			}
		}
	})
	return mux
}

// hsLogs records log messages, and passes them on for tests that wait for one.
type hsLogs struct {
	mu   sync.Mutex
	msgs []string
	c    chan string
}

func newHSLogs() *hsLogs { return &hsLogs{c: make(chan string, 1000)} }

func (h *hsLogs) Enabled(context.Context, slog.Level) bool { return true }
func (h *hsLogs) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *hsLogs) WithGroup(string) slog.Handler            { return h }
func (h *hsLogs) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.msgs = append(h.msgs, r.Message)
	h.mu.Unlock()
	select {
	case h.c <- r.Message:
	default:
	}
	return nil
}

func (h *hsLogs) count(substr string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, m := range h.msgs {
		if strings.Contains(m, substr) {
			n++
		}
	}
	return n
}

func (h *hsLogs) wait(t *testing.T, substr string) {
	t.Helper()
	bound := time.NewTimer(hsBound)
	defer bound.Stop()
	for {
		select {
		case m := <-h.c:
			if strings.Contains(m, substr) {
				return
			}
		case <-bound.C:
			t.Fatalf("no log message containing %q within %v", substr, hsBound)
		}
	}
}

func hsStart(t *testing.T, cfg httpServerConfig, h http.Handler, log *slog.Logger) (*connLimitListener, string) {
	t.Helper()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	srv, ln, err := newHTTPServer("127.0.0.1:0", h, cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		_ = srv.Close()
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	return ln, ln.Addr().String()
}

func hsDial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(hsBound))
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// hsGet sends one keep-alive request on c and reads the whole response.
func hsGet(t *testing.T, c net.Conn, path string) int {
	t.Helper()
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: test\r\n\r\n", path); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp.StatusCode
}

// hsProbe is the kubelet's liveness probe: a fresh connection per probe.
func hsProbe(addr string) error {
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: hsBound}
	resp, err := client.Get("http://" + addr + "/healthz")
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		return fmt.Errorf("probe: %s %q", resp.Status, body)
	}
	return nil
}

// hsReadUntilClosed reads until the server closes c and returns what came
// first; it fails the test if c is still open at the bound.
func hsReadUntilClosed(t *testing.T, c net.Conn) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(hsBound))
	var got strings.Builder
	_, err := io.Copy(&got, c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection still open after %v, having sent %q", hsBound, got.String())
	}
	// EOF, or a reset when the server closed with our bytes unread: both
	// are the server hanging up.
	return got.String()
}

// hsDribble writes s to c one byte at a time, and then filler bytes the
// same way, until writing fails or the test ends: a client that never
// finishes. The pace only shapes the attack; no outcome depends on it.
func hsDribble(t *testing.T, c net.Conn, s string) {
	done := make(chan struct{})
	stopped := make(chan struct{})
	t.Cleanup(func() { close(done); <-stopped })
	go func() {
		defer close(stopped)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			b := byte('a')
			if i < len(s) {
				b = s[i]
			}
			if _, err := c.Write([]byte{b}); err != nil {
				return
			}
			select {
			case <-tick.C:
			case <-done:
				return
			}
		}
	}()
}

func TestHTTPIdleKeepAlivesDoNotLockOutProbe(t *testing.T) {
	const limit, idlers = 8, 50
	logs := newHSLogs()
	cfg := hsConfig(limit)
	ln, addr := hsStart(t, cfg, newHSEndpoints().handler(), slog.New(logs))

	clients := make([]net.Conn, idlers)
	for i := range clients {
		clients[i] = hsDial(t, addr)
		if code := hsGet(t, clients[i], "/healthz"); code != http.StatusOK {
			t.Fatalf("client %d: status %d", i, code)
		}
	}
	if err := hsProbe(addr); err != nil {
		t.Fatal(err)
	}
	if p := ln.Peak(); p > limit {
		t.Errorf("%d connections open at once, limit %d", p, limit)
	}
	// Which idlers were closed depends on when each was seen to go idle,
	// but all but the last few have been hung up on: a newcomer is not
	// refused while an idle keep-alive can make room for it.
	hungUp := make(chan string, idlers)
	for _, c := range clients {
		go func() {
			got, err := io.ReadAll(c)
			if !errors.Is(err, os.ErrDeadlineExceeded) {
				hungUp <- string(got)
			}
		}()
	}
	shared := limit - cfg.ProbeReserve
	for range idlers - shared {
		select {
		case got := <-hungUp:
			if got != "" {
				t.Errorf("an idler got %q", got)
			}
		case <-time.After(hsBound):
			t.Fatalf("fewer than %d idlers hung up on", idlers-shared)
		}
	}
	if n := logs.count("limit reached"); n != 1 {
		t.Errorf("%d limit-reached log lines, want 1", n)
	}
	for _, c := range clients {
		_ = c.Close()
	}
	logs.wait(t, "back under")
}

func TestHTTPSlowHeaderFloodDoesNotLockOutProbe(t *testing.T) {
	const limit, slow = 8, 50
	ln, addr := hsStart(t, hsConfig(limit), newHSEndpoints().handler(), nil)
	for range slow {
		c := hsDial(t, addr)
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: a"); err != nil {
			t.Fatal(err)
		}
	}
	if err := hsProbe(addr); err != nil {
		t.Fatal(err)
	}
	if p := ln.Peak(); p > limit {
		t.Errorf("%d connections open at once, limit %d", p, limit)
	}
}

func TestHTTPSlowBodyFloodDoesNotLockOutProbe(t *testing.T) {
	const limit, slow = 8, 50
	ln, addr := hsStart(t, hsConfig(limit), newHSEndpoints().handler(), nil)
	for range slow {
		c := hsDial(t, addr)
		if _, err := io.WriteString(c, "POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\nabc"); err != nil {
			t.Fatal(err)
		}
	}
	if err := hsProbe(addr); err != nil {
		t.Fatal(err)
	}
	if p := ln.Peak(); p > limit {
		t.Errorf("%d connections open at once, limit %d", p, limit)
	}
}

func TestHTTPBusyConnectionsAreNotClosed(t *testing.T) {
	const limit = 4
	e := newHSEndpoints()
	cfg := hsConfig(limit)
	// So that the reserve's connections can be held busy too.
	cfg.ProbePaths = append(cfg.ProbePaths, "/block")
	ln, addr := hsStart(t, cfg, e.handler(), nil)
	t.Cleanup(func() { close(e.release) })

	busy := make([]net.Conn, limit)
	for i := range busy {
		busy[i] = hsDial(t, addr)
		if _, err := io.WriteString(busy[i], "GET /block HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		// One at a time, so none is still sending its request when the
		// next arrives and so closable.
		select {
		case <-e.entered:
		case <-time.After(hsBound):
			t.Fatalf("request %d not served", i)
		}
	}
	probed := make(chan error, 1)
	go func() { probed <- hsProbe(addr) }()
	// The probe waits for a slot; one busy connection going idle (or
	// closing, in the reserve) frees one.
	select {
	case e.release <- struct{}{}:
	case <-time.After(hsBound):
		t.Fatal("no handler to release")
	}
	if err := <-probed; err != nil {
		t.Fatal(err)
	}
	if p := ln.Peak(); p > limit {
		t.Errorf("%d connections open at once, limit %d", p, limit)
	}
	// Their handlers still hold the other three, which must not have been
	// closed to make room.
	if n := ln.Open(); n < limit-1 {
		t.Errorf("%d connections open, want the %d busy ones", n, limit-1)
	}
}

// kubeletProbeTimeout is the chart's timeoutSeconds for both probes (and
// the kubelet's default): an answer later than this is a failed probe.
const kubeletProbeTimeout = time.Second

// hsAnswer is how a scrape ended.
type hsAnswer struct {
	code       int
	retryAfter string
	err        error
}

// hsScrape asks /metrics on a fresh connection.
func hsScrape(ctx context.Context, addr string) hsAnswer {
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: hsBound}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return hsAnswer{err: err}
	}
	resp, err := client.Do(req)
	if err != nil {
		return hsAnswer{err: err}
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return hsAnswer{err: err}
	}
	return hsAnswer{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After")}
}

// refusedCleanly says what is wrong with a scraper's answer beyond the
// limit, if anything: it must be told to come back, not hung up on.
func (a hsAnswer) refusedCleanly() error {
	switch {
	case a.err != nil:
		return a.err
	case a.code != http.StatusServiceUnavailable || a.retryAfter == "":
		return fmt.Errorf("status %d, Retry-After %q; want 503 with Retry-After", a.code, a.retryAfter)
	}
	return nil
}

// TestHTTPProbesAnsweredThroughScrapeStorm: scrapes hold every connection
// the limit allows, crowds of scrapers come on top, and the kubelet's
// probes are still answered within its timeout; the scrapers are refused
// cleanly. Issue 23: under 500 fast scrapers 12
// of 18 liveness probes failed, up to 4 in a row.
func TestHTTPProbesAnsweredThroughScrapeStorm(t *testing.T) {
	const limit, stormers, rounds = 16, 2 * 16, 5
	e := newHSEndpoints()
	_, addr := hsStart(t, hsConfig(limit), e.handler(), nil)
	t.Cleanup(func() { close(e.release) })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	// Fill: as many scrapes as the limit has connections, each held in
	// its handler unless the server refused it. Both are events to wait
	// for; the refusals must be clean.
	refused := make(chan hsAnswer, limit)
	for range limit {
		go func() {
			if a := hsScrape(ctx, addr); a.code != http.StatusOK {
				refused <- a
			}
		}()
	}
	bound := time.NewTimer(hsBound)
	defer bound.Stop()
	for held, answered := 0, 0; held+answered < limit; {
		select {
		case <-e.entered:
			held++
		case a := <-refused:
			answered++
			if err := a.refusedCleanly(); err != nil {
				t.Errorf("scraper beyond the limit: %v", err)
			}
		case <-bound.C:
			t.Fatalf("after %v, %d scrapes held and %d answered of %d", hsBound, held, answered, limit)
		}
	}

	// A request beyond the limit that must be read to be refused: it has a
	// body.
	c := hsDial(t, addr)
	if _, err := io.WriteString(c, "POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n\r\nabc"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("POST beyond the limit: %v", err)
	}
	resp.Body.Close()
	if err := (hsAnswer{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After")}).refusedCleanly(); err != nil {
		t.Errorf("POST beyond the limit: %v", err)
	}

	// The storm: before each round of probes, a crowd of scrapers beyond
	// the limit, all at once; the probes go while they are answered.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: kubeletProbeTimeout}
	var storm sync.WaitGroup
	crowd := make(chan hsAnswer, rounds*stormers)
	for round := range rounds {
		for range stormers {
			storm.Go(func() { crowd <- hsScrape(ctx, addr) })
		}
		for _, path := range []string{"/healthz", "/readyz"} {
			began := time.Now()
			resp, err := client.Get("http://" + addr + path)
			if err != nil {
				t.Errorf("probe %d of %s: %v", round, path, err)
				continue
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if took := time.Since(began); err != nil || resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
				t.Errorf("probe %d of %s after %v: %s %q %v", round, path, took, resp.Status, body, err)
			}
		}
	}
	if t.Failed() {
		// The crowd is stuck where the probes were; nothing more to learn.
		cancel()
		storm.Wait()
		return
	}
	for range rounds * stormers {
		select {
		case a := <-crowd:
			if err := a.refusedCleanly(); err != nil {
				t.Errorf("scraper beyond the limit: %v", err)
			}
		case <-bound.C:
			t.Fatalf("a scraper beyond the limit still unanswered after %v", hsBound)
		}
	}
}

func TestHTTPSlowHeadersCutByReadHeaderTimeout(t *testing.T) {
	cfg := hsConfig(8)
	cfg.ReadHeaderTimeout = 200 * time.Millisecond
	_, addr := hsStart(t, cfg, newHSEndpoints().handler(), nil)
	c := hsDial(t, addr)
	hsDribble(t, c, "GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ")
	// net/http may say 400 as it hangs up, but must not have served it.
	if got := hsReadUntilClosed(t, c); strings.HasPrefix(got, "HTTP/1.1 200") {
		t.Errorf("headers never finished were answered %q", got)
	}
}

func TestHTTPSlowBodyCutByReadTimeout(t *testing.T) {
	cfg := hsConfig(8)
	cfg.ReadTimeout = 200 * time.Millisecond
	e := newHSEndpoints()
	_, addr := hsStart(t, cfg, e.handler(), nil)
	c := hsDial(t, addr)
	if _, err := io.WriteString(c, "POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	hsDribble(t, c, "")
	hsReadUntilClosed(t, c)
	select {
	case err := <-e.uploadErrs:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("body read ended with %v, want a deadline", err)
		}
	case <-time.After(hsBound):
		t.Fatal("handler still reading the body")
	}
}

func TestHTTPIdleKeepAliveCutByIdleTimeout(t *testing.T) {
	cfg := hsConfig(8)
	cfg.IdleTimeout = 200 * time.Millisecond
	_, addr := hsStart(t, cfg, newHSEndpoints().handler(), nil)
	c := hsDial(t, addr)
	if code := hsGet(t, c, "/healthz"); code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	if got := hsReadUntilClosed(t, c); got != "" {
		t.Errorf("unexpected %q", got)
	}
}

func TestHTTPSlowReaderCutByWriteTimeout(t *testing.T) {
	cfg := hsConfig(8)
	cfg.WriteTimeout = 200 * time.Millisecond
	e := newHSEndpoints()
	_, addr := hsStart(t, cfg, e.handler(), nil)
	c := hsDial(t, addr)
	// Never read: the response fills the socket buffers and stalls.
	if _, err := io.WriteString(c, "GET /flood HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-e.floodErrs:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("response write ended with %v, want a deadline", err)
		}
	case <-time.After(hsBound):
		t.Fatal("handler still writing")
	}
}

func TestHTTPSizeLimits(t *testing.T) {
	t.Run("headers", func(t *testing.T) {
		cfg := hsConfig(8)
		cfg.MaxHeaderBytes = 1 << 10
		_, addr := hsStart(t, cfg, newHSEndpoints().handler(), nil)
		c := hsDial(t, addr)
		// Past MaxHeaderBytes and the slack net/http adds to it.
		big := strings.Repeat("a", 16<<10)
		if _, err := fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: test\r\nX-Big: %s\r\n\r\n", big); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Errorf("status %d, want 431", resp.StatusCode)
		}
	})
	t.Run("body", func(t *testing.T) {
		cfg := hsConfig(8)
		cfg.MaxBodyBytes = 10
		e := newHSEndpoints()
		_, addr := hsStart(t, cfg, e.handler(), nil)
		c := hsDial(t, addr)
		body := strings.Repeat("a", 100)
		if _, err := fmt.Fprintf(c, "POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-e.uploadErrs:
			var tooBig *http.MaxBytesError
			if !errors.As(err, &tooBig) {
				t.Errorf("body read ended with %v, want MaxBytesError", err)
			}
		case <-time.After(hsBound):
			t.Fatal("handler still reading the body")
		}
	})
}

// hsReadable waits until c has bytes to read, without reading them.
func hsReadable(t *testing.T, c net.Conn) {
	t.Helper()
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(hsBound))
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return err == nil && n > 0
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestConnLimitClosesLongestWaitingFirst(t *testing.T) {
	l := newConnLimitListener(nil, 12, 3, nil, slog.New(slog.DiscardHandler))
	now := time.Now()
	names := map[*limitedConn]string{}
	add := func(name string, nc net.Conn, p connPhase, reading bool, age time.Duration) {
		c := &limitedConn{Conn: nc, l: l, phase: p, reading: reading, since: now.Add(-age)}
		l.conns[c] = struct{}{}
		l.shared++
		names[c] = name
	}
	pipe := func() net.Conn {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		return a
	}
	add("busy", pipe(), phaseBusy, true, 10*time.Second) // the server's read ahead
	add("idle 1s", pipe(), phaseIdle, true, time.Second)
	add("idle 2s", pipe(), phaseIdle, true, 2*time.Second)
	add("headers 5s", pipe(), phaseNew, true, 5*time.Second)
	add("body 3s", pipe(), phaseBody, true, 3*time.Second)
	// The server has its request (or is yet to read the socket).
	add("not reading", pipe(), phaseNew, false, 9*time.Second)
	add("idle, not reading", pipe(), phaseIdle, false, 8*time.Second)

	// A request in the socket buffer, its reader about to take it.
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer inner.Close()
	client := hsDial(t, inner.Addr().String())
	server, err := inner.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	if _, err := io.WriteString(client, "GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	hsReadable(t, server)
	add("request arrived", server, phaseIdle, true, 7*time.Second)

	for _, want := range []string{"idle 2s", "idle 1s", "headers 5s", "body 3s", ""} {
		l.mu.Lock()
		got := ""
		if l.evictLocked(func(*limitedConn) bool { return true }) {
			for c := range l.conns {
				if c.closing {
					// As if its reader had closed it.
					got = names[c]
					delete(l.conns, c)
					l.closing--
				}
			}
		}
		l.mu.Unlock()
		if got != want {
			t.Fatalf("closed %q, want %q", got, want)
		}
	}
}

func TestBodilessGET(t *testing.T) {
	for _, tc := range []struct {
		req  string
		path string // "" for not one whole bodiless GET
	}{
		{"GET /metrics HTTP/1.1\r\nHost: node:9400\r\nAccept: text/plain\r\n\r\n", "/metrics"},
		{"GET /metrics?name[]=up HTTP/1.1\r\nHost: x\r\n\r\n", "/metrics"},
		{"GET /healthz HTTP/1.0\r\n\r\n", "/healthz"},
		{"GET /metrics HTTP/1.1\r\nHost: x\r\n", ""},                             // headers not ended
		{"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /status HTTP/1.1\r\n", ""}, // more behind it
		{"GET /metrics HTTP/1.1\r\ncontent-length: 3\r\n\r\n", ""},
		{"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", ""},
		{"POST /sim/xid HTTP/1.1\r\nHost: x\r\n\r\n", ""},
		{"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", ""},
		{"GET http://node/metrics HTTP/1.1\r\nHost: x\r\n\r\n", ""},
		{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", ""},
		{"GET /metrics\r\n\r\n", ""},
		{"", ""},
	} {
		path, ok := bodilessGET([]byte(tc.req))
		if path != tc.path || ok != (tc.path != "") {
			t.Errorf("bodilessGET(%q) = %q, %v; want %q", tc.req, path, ok, tc.path)
		}
	}
}
