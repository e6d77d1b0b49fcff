package plugin

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// logRecorder keeps every record logged through its handlers.
type logRecorder struct {
	mu   sync.Mutex
	recs []loggedRecord
}

type loggedRecord struct {
	msg   string
	level slog.Level
	attrs map[string]string // including the logger's own (With)
}

func (l *logRecorder) handler() slog.Handler { return &recordHandler{rec: l} }

// named returns the records with message msg logged for resource res.
func (l *logRecorder) named(msg, res string) []loggedRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []loggedRecord
	for _, r := range l.recs {
		if r.msg == msg && r.attrs["resource"] == res {
			out = append(out, r)
		}
	}
	return out
}

type recordHandler struct {
	rec   *logRecorder
	attrs []slog.Attr
}

func (h *recordHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h *recordHandler) Handle(_ context.Context, r slog.Record) error {
	lr := loggedRecord{msg: r.Message, level: r.Level, attrs: map[string]string{}}
	for _, a := range h.attrs {
		lr.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		lr.attrs[a.Key] = a.Value.String()
		return true
	})
	h.rec.mu.Lock()
	h.rec.recs = append(h.rec.recs, lr)
	h.rec.mu.Unlock()
	return nil
}

func (h *recordHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &recordHandler{rec: h.rec, attrs: append(slices.Clip(h.attrs), as...)}
}

func (h *recordHandler) WithGroup(string) slog.Handler { return h } // the package uses no groups

// manualClock is a clock that moves only when told to.
type manualClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *manualClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func TestRefusalLogRateLimited(t *testing.T) {
	dir := shortDir(t)
	var rec logRecorder
	clock := &manualClock{t: time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC)}
	startManagerWith(t, testCatalog(), Options{Dir: dir, Logger: slog.New(rec.handler()), Now: clock.Now})
	gpus := dialPlugin(t, filepath.Join(dir, sockGPU))
	shared := dialPlugin(t, filepath.Join(dir, sockShared))
	ctx := context.Background()
	refuse := func(c pluginapi.DevicePluginClient, req *pluginapi.AllocateRequest) {
		t.Helper()
		if _, err := c.Allocate(ctx, req); err == nil {
			t.Fatal("Allocate succeeded, want a refusal")
		}
	}
	// Allocate logs before it answers, so the count is exact on return.
	lines := func(res string) []loggedRecord { return rec.named("allocation refused", res) }

	refuse(gpus, allocReq([]string{"GPU-zz"}))
	if got := lines(resGPU); len(got) != 1 || got[0].level != slog.LevelWarn || got[0].attrs["suppressed"] != "0" ||
		got[0].attrs["code"] != "NotFound" || !strings.Contains(got[0].attrs["err"], `"GPU-zz"`) {
		t.Fatalf("after the first refusal: %+v, want one WARN line naming the device", got)
	}

	// Within the interval: counted, not logged.
	for range 4 {
		refuse(gpus, allocReq([]string{"GPU-zz"}))
	}
	clock.Advance(refusalLogInterval - time.Nanosecond)
	refuse(gpus, allocReq([]string{"GPU-a", "GPU-a"}))
	if got := lines(resGPU); len(got) != 1 {
		t.Fatalf("%d lines within the interval, want 1", len(got))
	}

	// Another resource has a limit of its own.
	refuse(shared, allocReq([]string{"GPU-zz::0"}))
	if got := lines(resShared); len(got) != 1 {
		t.Fatalf("%s: %d lines, want 1", resShared, len(got))
	}

	// The interval over: one line, carrying the refusals it left out.
	clock.Advance(time.Nanosecond)
	huge := strings.Repeat("x", 1<<20)
	many := append([]string{huge}, make([]string, 999)...)
	for i := 1; i < len(many); i++ {
		many[i] = fmt.Sprintf("GPU-%d", i)
	}
	refuse(gpus, allocReq(many))
	got := lines(resGPU)
	if len(got) != 2 || got[1].attrs["suppressed"] != "5" {
		t.Fatalf("lines after the interval: %+v, want a second one with suppressed=5", got)
	}
	// A line names a few devices and the count, never the whole request.
	l := got[1]
	if l.attrs["requested"] != "1000" || l.attrs["containers"] != "1" {
		t.Errorf("requested=%s containers=%s, want 1000 and 1", l.attrs["requested"], l.attrs["containers"])
	}
	if n := strings.Count(l.attrs["devices"], `"`); n != 2*maxListedIDs {
		t.Errorf("devices = %.200s: %d quoted IDs, want %d", l.attrs["devices"], n/2, maxListedIDs)
	}
	if !strings.Contains(l.attrs["devices"], fmt.Sprintf("... (%d bytes)", len(huge))) {
		t.Errorf("devices = %.200s: the long ID is not cut short", l.attrs["devices"])
	}
	size := 0
	for k, v := range l.attrs {
		size += len(k) + len(v)
	}
	if size > 2048 {
		t.Errorf("log line of %d bytes for a refused request", size)
	}

	// GetPreferredAllocation's refusals are limited the same way.
	for range 3 {
		if _, err := gpus.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
			ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{prefReq([]string{"GPU-a"}, nil, 0)},
		}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("GetPreferredAllocation of size 0: %v", err)
		}
	}
	if got := rec.named("GetPreferredAllocation failed", resGPU); len(got) != 1 {
		t.Errorf("%d GetPreferredAllocation lines, want 1", len(got))
	}
}

func TestRefusalsOverGRPC(t *testing.T) {
	dir := shortDir(t)
	cat := withHealth(testCatalog(), resGPU, "GPU-b", false, "XID 79")
	cat.Resources[resShared].Preferred = preferFunc(func([]string, []string, int) ([]string, error) {
		return nil, status.Error(codes.Unavailable, "topology unknown")
	})
	startManager(t, dir, cat)
	gpus := dialPlugin(t, filepath.Join(dir, sockGPU))
	shared := dialPlugin(t, filepath.Join(dir, sockShared))
	ctx := context.Background()
	huge := strings.Repeat("x", 1<<20)

	tests := []struct {
		name     string
		call     func() error
		code     codes.Code
		contains []string
	}{
		{"unknown ID in the second container", func() error {
			_, err := gpus.Allocate(ctx, allocReq([]string{"GPU-a"}, []string{"GPU-zz"}))
			return err
		}, codes.NotFound, []string{"container request 1: ", resGPU, `unknown device "GPU-zz"`}},
		{"unhealthy", func() error {
			_, err := gpus.Allocate(ctx, allocReq([]string{"GPU-b"}))
			return err
		}, codes.FailedPrecondition, []string{"container request 0: ", `"GPU-b" is unhealthy: XID 79`}},
		{"duplicate ID", func() error {
			_, err := gpus.Allocate(ctx, allocReq([]string{"GPU-a", "GPU-c", "GPU-a"}))
			return err
		}, codes.InvalidArgument, []string{"container request 0: ", resGPU, `device "GPU-a" requested twice`}},
		{"more IDs than devices", func() error {
			_, err := gpus.Allocate(ctx, allocReq([]string{"GPU-a", "GPU-c"}, []string{"GPU-d", "GPU-x", "GPU-y"}))
			return err
		}, codes.InvalidArgument, []string{resGPU, "5 device IDs requested, more than the 4 devices it has"}},
		{"no container requests", func() error {
			_, err := gpus.Allocate(ctx, &pluginapi.AllocateRequest{})
			return err
		}, codes.InvalidArgument, []string{resGPU, "no container requests"}},
		{"ID of a megabyte", func() error {
			_, err := gpus.Allocate(ctx, allocReq([]string{huge}))
			return err
		}, codes.NotFound, []string{"container request 0: ", fmt.Sprintf("... (%d bytes)", len(huge))}},
		{"preferred: second container invalid", func() error {
			_, err := gpus.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
				ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{
					prefReq([]string{"GPU-a"}, nil, 1), prefReq([]string{"GPU-a"}, []string{"GPU-q"}, 1),
				},
			})
			return err
		}, codes.InvalidArgument, []string{"container request 1: ", `must-include device "GPU-q" is not available`}},
		{"preferred: Preferrer's status error", func() error {
			_, err := shared.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{
				ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{prefReq([]string{"GPU-a::0"}, nil, 1)},
			})
			return err
		}, codes.Internal, []string{"container request 0: ", "preferred allocation: topology unknown"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			st, ok := status.FromError(err)
			if !ok || st.Code() != tt.code {
				t.Fatalf("err = %v, want code %v", err, tt.code)
			}
			msg := st.Message()
			if n := strings.Count(msg, "rpc error"); n != 0 {
				t.Errorf("message %q holds %q %d times, want none", msg, "rpc error", n)
			}
			for _, s := range tt.contains {
				if !strings.Contains(msg, s) {
					t.Errorf("message %.300q does not contain %q", msg, s)
				}
			}
			if len(msg) > 512 {
				t.Errorf("message of %d bytes", len(msg))
			}
		})
	}
}

func TestInvalidResourceNamesNotServed(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	good := testCatalog().Resources[resGPU]
	bad := map[string]string{
		"":                                       "empty resource name",
		"gpu":                                    "must be <domain>/<name>",
		"Example.com/gpu":                        "not a DNS subdomain",
		"example.com/":                           "must be 1 to 63",
		"example.com/a/b":                        "must be 1 to 63",
		"kubernetes.io/gpu":                      "reserved by Kubernetes",
		"requests.example.com/x":                 "reserved by Kubernetes",
		"example.com/" + strings.Repeat("g", 64): "must be 1 to 63",
	}
	cat := &catalog.Catalog{Resources: map[string]*catalog.Resource{resGPU: good}}
	for name := range bad {
		cat.Resources[name] = good
	}
	m, _ := runManager(t, cat, Options{Dir: dir})
	k.waitRegistered(t, 2*time.Second, resGPU)
	testwait.For(t, "every bad name rejected in Status", func() bool {
		for _, st := range m.Status() {
			if want, isBad := bad[st.Name]; isBad && !strings.Contains(st.LastError, want) {
				return false
			}
		}
		return true
	})
	for _, st := range m.Status() {
		if _, isBad := bad[st.Name]; isBad && (st.Registered || st.LastError == "") {
			t.Errorf("%q: %+v, want rejected", st.Name, st)
		}
	}
	entries, _ := os.ReadDir(dir)
	var socks []string
	for _, e := range entries {
		socks = append(socks, e.Name())
	}
	if want := []string{sockGPU, kubeletSocket}; !slices.Equal(socks, want) {
		t.Errorf("sockets %v, want %v", socks, want)
	}
}

func TestServedAgainAfterServeFailed(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	// A non-empty directory where the socket goes makes serving fail, as a
	// starting kubelet deleting the socket mid-serve does.
	blocker := filepath.Join(dir, sockGPU)
	if err := os.MkdirAll(filepath.Join(blocker, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	cat := &catalog.Catalog{Resources: map[string]*catalog.Resource{resGPU: testCatalog().Resources[resGPU]}}
	m, _ := runManager(t, cat, Options{Dir: dir})
	testwait.For(t, "serve failure in Status", func() bool {
		st := m.Status()
		return len(st) == 1 && strings.Contains(st[0].LastError, "remove old socket")
	})

	// Its removal is the only event that follows: it must be served again.
	if err := os.RemoveAll(blocker); err != nil {
		t.Fatal(err)
	}
	k.waitRegistered(t, 2*time.Second, resGPU)
	fi, err := os.Lstat(blocker)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("%s after serving again: %v, %v", blocker, fi, err)
	}
}

// TestAllocatedLoggedAtDebug: a successful Allocate is logged at debug
// only, with every container's IDs, and at info not at all.
func TestAllocatedLoggedAtDebug(t *testing.T) {
	for _, tt := range []struct {
		level slog.Level
		want  string // "": no line
	}{
		{slog.LevelDebug, `"msg":"allocated","resource":"example.com/gpu","devices":[["GPU-b","GPU-a"],["GPU-c"]]`},
		{slog.LevelInfo, ""},
	} {
		var buf bytes.Buffer
		log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: tt.level}))
		e := &endpoint{r: newResource(resGPU, sockGPU, "", testCatalog().Resources[resGPU], log, time.Now)}
		if _, err := e.Allocate(context.Background(), allocReq([]string{"GPU-b", "GPU-a"}, []string{"GPU-c"})); err != nil {
			t.Fatal(err)
		}
		if got := buf.String(); tt.want == "" && got != "" || !strings.Contains(got, tt.want) {
			t.Errorf("at %s, logged %q, want a line with %s", tt.level, got, tt.want)
		}
	}
}
