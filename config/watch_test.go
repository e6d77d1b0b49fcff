package config

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// configMapDir lays a directory out the way the kubelet mounts a ConfigMap:
//
//	..2026_11_22_10_00_00.1/config.yaml
//	..data -> ..2026_11_22_10_00_00.1
//	config.yaml -> ..data/config.yaml
//
// and updates it as the kubelet's atomic writer does.
type configMapDir struct {
	t   *testing.T
	dir string
	n   int
	cur string // current timestamped dir
}

func newConfigMapDir(t *testing.T, dir, content string) *configMapDir {
	t.Helper()
	c := &configMapDir{t: t, dir: dir}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	c.cur = c.writeVersion(content)
	c.must(os.Symlink(c.cur, filepath.Join(dir, "..data")))
	c.must(os.Symlink(filepath.Join("..data", "config.yaml"), filepath.Join(dir, "config.yaml")))
	return c
}

func (c *configMapDir) must(err error) {
	c.t.Helper()
	if err != nil {
		c.t.Fatal(err)
	}
}

// writeVersion writes a new timestamped directory holding content.
func (c *configMapDir) writeVersion(content string) string {
	c.t.Helper()
	c.n++
	name := fmt.Sprintf("..2026_11_22_10_%02d_00.%d", c.n, c.n)
	c.must(os.Mkdir(filepath.Join(c.dir, name), 0o755))
	c.must(os.WriteFile(filepath.Join(c.dir, name, "config.yaml"), []byte(content), 0o644))
	return name
}

// publish swaps in new content: new dir, ..data_tmp symlink renamed over
// ..data (atomic), old dir removed.
func (c *configMapDir) publish(content string) {
	c.t.Helper()
	next := c.writeVersion(content)
	tmp := filepath.Join(c.dir, "..data_tmp")
	c.must(os.Symlink(next, tmp))
	c.must(os.Rename(tmp, filepath.Join(c.dir, "..data")))
	c.must(os.RemoveAll(filepath.Join(c.dir, c.cur)))
	c.cur = next
}

// startWatcher runs a fast watcher on path and stops it at the end of the
// test. grace is its ErrorGrace: generous where a test relies on a short
// absence not being reported, on a machine that may be loaded.
func startWatcher(t *testing.T, path string, grace time.Duration) <-chan Update {
	t.Helper()
	return startLoggedWatcher(t, path, grace, slog.New(slog.DiscardHandler))
}

// logMessages is a slog.Handler that hands each record's message, at any
// level, to a channel: a test waits there for what the watcher did.
type logMessages chan string

func (l logMessages) Enabled(context.Context, slog.Level) bool { return true }
func (l logMessages) Handle(_ context.Context, r slog.Record) error {
	select {
	case l <- r.Message:
	default: // nobody waits for it
	}
	return nil
}
func (l logMessages) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l logMessages) WithGroup(string) slog.Handler      { return l }

func startLoggedWatcher(t *testing.T, path string, grace time.Duration, logger *slog.Logger) <-chan Update {
	t.Helper()
	w, err := NewWatcher(path, logger)
	if err != nil {
		t.Fatal(err)
	}
	w.Debounce = 20 * time.Millisecond
	w.ErrorGrace = grace
	w.Rewatch = 50 * time.Millisecond
	w.Resync = 0
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan Update)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, out) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run returned %v after cancel, want nil", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return out
}

func recv(t *testing.T, ch <-chan Update) Update {
	t.Helper()
	select {
	case u := <-ch:
		return u
	case <-time.After(5 * time.Second):
		t.Fatal("no update within 5s")
		return Update{}
	}
}

func expectData(t *testing.T, ch <-chan Update, want string) {
	t.Helper()
	u := recv(t, ch)
	if u.Err != nil || string(u.Data) != want {
		t.Fatalf("update = {%q, %v}, want %q", u.Data, u.Err, want)
	}
}

// expectNone asserts that nothing arrives for a while (well beyond the
// debounce), which is how "no update" is observable.
func expectNone(t *testing.T, ch <-chan Update) {
	t.Helper()
	select {
	case u := <-ch:
		t.Fatalf("unexpected update {%q, %v}", u.Data, u.Err)
	case <-time.After(400 * time.Millisecond):
	}
}

func TestWatcherConfigMapSwap(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "config")
	cm := newConfigMapDir(t, dir, "version: v1 # one\n")
	ch := startWatcher(t, filepath.Join(dir, "config.yaml"), 300*time.Millisecond)

	expectData(t, ch, "version: v1 # one\n")

	cm.publish("version: v1 # two\n")
	expectData(t, ch, "version: v1 # two\n")

	// The kubelet rewrites on resync too; same content must not be re-sent.
	cm.publish("version: v1 # two\n")
	expectNone(t, ch)

	cm.publish("version: v1 # three\n")
	expectData(t, ch, "version: v1 # three\n")
}

func TestWatcherFileAbsent(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := make(logMessages, 64)
	ch := startLoggedWatcher(t, path, time.Second, slog.New(logs))
	expectData(t, ch, "a")

	// Gone for a moment (the watcher read it gone) and back unchanged:
	// nothing to report.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "the watcher finding the file gone", logs, func(m string) bool {
		return m == "config file unreadable; looking again before reporting"
	})
	if err := os.WriteFile(path, []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	expectNone(t, ch)

	// Gone for longer than ErrorGrace: one error.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if u := recv(t, ch); u.Err == nil || !os.IsNotExist(unwrapAll(u.Err)) {
		t.Fatalf("update = {%q, %v}, want a not-exist error", u.Data, u.Err)
	}
	expectNone(t, ch)

	// Back with the same content: sent again, as the consumer saw an error.
	if err := os.WriteFile(path, []byte("a"), 0o644); err != nil {
		t.Fatal(err)
	}
	expectData(t, ch, "a")
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}

func TestWatcherDirRecreated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "config")
	newConfigMapDir(t, dir, "one")
	ch := startWatcher(t, filepath.Join(dir, "config.yaml"), 300*time.Millisecond)
	expectData(t, ch, "one")

	// The volume is re-mounted: the directory disappears and a new one with
	// the same name appears (a new inode, which the old watch does not see).
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	cm := newConfigMapDir(t, dir, "two")
	// Depending on timing an error may come first (if the directory stayed
	// away past ErrorGrace); the content must follow.
	for {
		u := recv(t, ch)
		if u.Err != nil {
			continue
		}
		if string(u.Data) != "two" {
			t.Fatalf("update = %q, want two", u.Data)
		}
		break
	}
	// And the new directory is watched.
	cm.publish("three")
	expectData(t, ch, "three")
}

func TestWatcherStartsWithoutDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "later")
	ch := startWatcher(t, filepath.Join(dir, "config.yaml"), 300*time.Millisecond)
	if u := recv(t, ch); u.Err == nil {
		t.Fatalf("first update = %q, want the read error", u.Data)
	}
	newConfigMapDir(t, dir, "hello")
	expectData(t, ch, "hello")
}

func TestNewWatcherRejectsEmptyPath(t *testing.T) {
	if _, err := NewWatcher("", nil); err == nil {
		t.Error("NewWatcher(\"\") succeeded")
	}
}

// replaceWith puts content at path atomically (a rename), except over a
// directory, which has to be removed first.
func replaceWith(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	must(t, os.WriteFile(tmp, []byte(content), 0o644))
	if fi, err := os.Lstat(path); err == nil && fi.IsDir() {
		must(t, os.RemoveAll(path))
	}
	must(t, os.Rename(tmp, path))
}

func expectRefusal(t *testing.T, ch <-chan Update, path, reason string) {
	t.Helper()
	u := recv(t, ch)
	if u.Err == nil {
		t.Fatalf("update = %d bytes, want an error", len(u.Data))
	}
	if msg := u.Err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, reason) {
		t.Fatalf("update error = %q, want it to name %s and say %q", msg, path, reason)
	}
}

func TestWatcherRefusesHostileFiles(t *testing.T) {
	for _, h := range hostileFiles() {
		if h.name == "directory" {
			continue // a directory given as --config is a ConfigMap volume (TestWatcherConfigMapDirectory)
		}
		t.Run(h.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "config.yaml")
			h.make(t, path)
			ch := startWatcher(t, path, 300*time.Millisecond)
			expectRefusal(t, ch, path, h.reason)

			// The watcher goes on, and delivers the next good content.
			replaceWith(t, path, "version: v1 # good\n")
			expectData(t, ch, "version: v1 # good\n")
		})
	}
}

func TestWatcherRefusalAfterGoodContent(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	must(t, os.WriteFile(path, []byte("one"), 0o644))
	ch := startWatcher(t, path, 50*time.Millisecond)
	expectData(t, ch, "one")

	// A FIFO renamed over the file: reported once it outlasts ErrorGrace,
	// without the watcher blocking on it.
	fifo := filepath.Join(dir, "fifo")
	must(t, syscall.Mkfifo(fifo, 0o644))
	must(t, os.Rename(fifo, path))
	expectRefusal(t, ch, path, "not a regular file (a named pipe)")

	replaceWith(t, path, "two")
	expectData(t, ch, "two")
}

// A ConfigMap volume given as the path: every key is delivered, and a
// kubelet-style update (the ..data swap) delivers the new set.
func TestWatcherConfigMapDirectory(t *testing.T) {
	dir := t.TempDir()
	write := func(stamp string, files map[string]string) {
		ts := filepath.Join(dir, stamp)
		must(t, os.Mkdir(ts, 0o755))
		for k, v := range files {
			must(t, os.WriteFile(filepath.Join(ts, k), []byte(v), 0o644))
		}
		must(t, os.Symlink(stamp, filepath.Join(dir, "..data_tmp")))
		must(t, os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")))
		for k := range files {
			link := filepath.Join(dir, k)
			if _, err := os.Lstat(link); err != nil {
				must(t, os.Symlink(filepath.Join("..data", k), link))
			}
		}
	}
	write("..2026_11_23_01", map[string]string{"a100": "version: v1\n", "config.default": "x"})
	ch := startWatcher(t, dir, 300*time.Millisecond)
	u := recv(t, ch)
	if u.Err != nil || len(u.Files) != 2 || u.Files["a100"] != "version: v1\n" {
		t.Fatalf("first update %+v, want both keys", u)
	}
	write("..2026_11_23_02", map[string]string{"a100": "version: v1 # edited\n", "config.default": "x"})
	u = recv(t, ch)
	if u.Err != nil || u.Files["a100"] != "version: v1 # edited\n" {
		t.Fatalf("after the swap %+v", u)
	}

	// Defect: keys and values were joined with NUL bytes to tell versions
	// apart, so a value holding NULs could read like two keys, and the
	// change was never delivered. Each version here must be.
	for i, files := range []map[string]string{
		{"a": "x", "b": "y"},
		{"a": "x\x00b\x00y"},
		{"a": "x\x00b", "y": ""},
	} {
		write(fmt.Sprintf("..2026_11_23_1%d", i), files)
		u = recv(t, ch)
		if u.Err != nil || !maps.Equal(u.Files, files) {
			t.Fatalf("version %d: update %+v, want %q", i, u, files)
		}
	}
}

// A ConfigMap manifest given as the config file is read as the ConfigMap it
// describes (every key a config), as `config validate` reads it: the agent
// serves what validate said was valid instead of refusing the file.
func TestWatcherReadsConfigMapManifest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "manifest.yaml")
	manifest := "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: gpu-agent-config\ndata:\n  config.yaml: |\n    version: v1\n    configs:\n      default: {}\n"
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	u := recv(t, startWatcher(t, path, 0))
	if u.Err != nil || u.Data != nil || u.Files["config.yaml"] != "version: v1\nconfigs:\n  default: {}\n" {
		t.Fatalf("update = {data %q, files %q, %v}, want the manifest's config.yaml as a ConfigMap key", u.Data, u.Files, u.Err)
	}
	f, _, err := u.Parse("")
	if err != nil || f.Configs["default"] == nil {
		t.Fatalf("parsed %+v, %v", f, err)
	}
}
