// Package plugin serves a catalog to the kubelet as device plugins: one gRPC
// server per resource name on a unix socket, registered with the kubelet and
// re-registered whenever the kubelet restarts. It never looks at hardware or
// config; it serves exactly the catalog it was last given.
package plugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
)

const (
	// DefaultDir is where the kubelet looks for device plugin sockets.
	DefaultDir = "/var/lib/kubelet/device-plugins"
	// socketPrefix marks our sockets, so that stale ones from an earlier run
	// can be removed without touching other plugins'.
	socketPrefix   = "gpu-agent-"
	kubeletSocket  = "kubelet.sock"
	maxBackoff     = 10 * time.Second
	defaultBackoff = 250 * time.Millisecond
	// The kubelet dials the plugin back (for about 1 s) before answering Register.
	registerTimeout = 5 * time.Second
)

// Options configure a Manager.
type Options struct {
	// Dir is the device plugin directory holding kubelet.sock (default DefaultDir).
	Dir    string
	Logger *slog.Logger
	// SocketName maps a resource name to its socket file name in Dir
	// (default "gpu-agent-" + sanitized name + ".sock").
	SocketName func(resource string) string
	// RetryBackoff is the first delay between registration attempts; it
	// doubles up to 10 s (default 250 ms).
	RetryBackoff time.Duration
	// Admit, when set, is called by every Allocate that the catalog allows,
	// before it answers, with the devices the containers get (each GPU or
	// MIG UUID once, and whether it goes as a shared replica); an error
	// refuses the call. It is the agent's ledger, which refuses devices
	// taken another way since the catalog was published (the same silicon
	// handed out under another name included) and records the rest
	// durably. An error that is ledger.ErrLogUnavailable answers
	// Unavailable; any other FailedPrecondition, with its message. From the
	// gRPC goroutine: it must be quick.
	Admit func(resource string, devices []Handout) error
	// OnAllocate, when set, is called after every successful Allocate (from
	// the gRPC goroutine; it must not block): pod attribution refreshes then
	// instead of polling the kubelet. ids may be the request's own list,
	// which it must not change.
	OnAllocate func(resource string, ids []string)
	// Now is the clock of registration times and of the rate limit on
	// logging refused calls (default time.Now).
	Now func() time.Time
}

// ResourceStatus is the serving and registration state of one resource.
type ResourceStatus struct {
	Name string `json:"name"`
	// Socket is the path of the resource's socket.
	Socket       string    `json:"socket"`
	Registered   bool      `json:"registered"`
	RegisteredAt time.Time `json:"registeredAt,omitzero"`
	LastError    string    `json:"lastError,omitempty"`
	Devices      int       `json:"devices"`
	Healthy      int       `json:"healthy"`
}

// Manager serves the latest catalog to the kubelet. Create with NewManager,
// feed with Update and run with Run.
type Manager struct {
	opts        Options
	log         *slog.Logger
	kubeletPath string

	wake    chan struct{} // a new catalog is waiting (capacity 1)
	reserve chan string   // a registration failed and the socket looks gone

	mu      sync.Mutex
	cat     *catalog.Catalog
	running bool
	// served and rejected are written only by the Run goroutine, under mu
	// so that Status can read them. rejected holds why a resource of the
	// catalog is not served.
	served   map[string]*resource
	rejected map[string]string
	// kubeletGone is set from kubelet.sock's removal to its creation (Run
	// goroutine only).
	kubeletGone bool

	wg sync.WaitGroup // goroutines started by Run
}

// NewManager checks opts and applies defaults.
func NewManager(opts Options) (*Manager, error) {
	if opts.Dir == "" {
		opts.Dir = DefaultDir
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("device plugin dir %q: %w", opts.Dir, err)
	}
	opts.Dir = dir
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.SocketName == nil {
		opts.SocketName = DefaultSocketName
	}
	if opts.RetryBackoff <= 0 {
		opts.RetryBackoff = defaultBackoff
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Manager{
		opts:        opts,
		log:         opts.Logger,
		kubeletPath: filepath.Join(dir, kubeletSocket),
		wake:        make(chan struct{}, 1),
		reserve:     make(chan string),
		served:      map[string]*resource{},
		rejected:    map[string]string{},
	}, nil
}

// DefaultSocketName is "gpu-agent-" + name + ".sock" with "/" turned into
// "-" and anything else outside [A-Za-z0-9._-] into "_":
// nvidia.com/gpu → gpu-agent-nvidia.com-gpu.sock.
func DefaultSocketName(resource string) string {
	var b strings.Builder
	b.WriteString(socketPrefix)
	for _, c := range resource {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '-', c == '_':
			b.WriteRune(c)
		case c == '/':
			b.WriteByte('-')
		default:
			b.WriteByte('_')
		}
	}
	b.WriteString(".sock")
	return b.String()
}

// Update makes c the catalog to serve. It may be called before or while Run
// runs; Run applies only the latest catalog. c must not be modified afterwards.
func (m *Manager) Update(c *catalog.Catalog) {
	m.mu.Lock()
	m.cat = c
	m.mu.Unlock()
	select {
	case m.wake <- struct{}{}:
	default:
	}
}

// Status lists the resources of the latest catalog in name order.
func (m *Manager) Status() []ResourceStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []ResourceStatus
	for _, name := range m.cat.Names() {
		if r, ok := m.served[name]; ok {
			out = append(out, r.status())
			continue
		}
		st := ResourceStatus{
			Name: name, Socket: filepath.Join(m.opts.Dir, m.opts.SocketName(name)),
			LastError: "not served yet",
		}
		if why, ok := m.rejected[name]; ok {
			st.LastError = why
		}
		st.Devices, st.Healthy = countDevices(m.cat.Resources[name])
		out = append(out, st)
	}
	return out
}

// Ready reports whether Run is running and every resource of the latest
// catalog is registered with the current kubelet.
func (m *Manager) Ready() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.running || m.cat == nil {
		return false
	}
	for _, name := range m.cat.Names() {
		r, ok := m.served[name]
		if !ok || !r.isRegistered() {
			return false
		}
	}
	return true
}

// Run serves the catalog until ctx is done, then stops every server, removes
// every socket and returns nil. It returns an error only when it cannot watch
// Dir. A missing kubelet is waited for, never an error.
func (m *Manager) Run(ctx context.Context) error {
	m.mu.Lock()
	if m.running {
		m.mu.Unlock()
		return errors.New("plugin manager: Run already running")
	}
	m.running = true
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		m.running = false
		m.mu.Unlock()
	}()

	dir := m.opts.Dir
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("device plugin dir %s: %w", dir, err)
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch device plugin dir %s: %w", dir, err)
	}
	defer w.Close()
	// Watch before the first look at kubelet.sock, so that a kubelet
	// starting in between is seen by one or the other.
	if err := w.Add(dir); err != nil {
		return fmt.Errorf("watch device plugin dir %s: %w", dir, err)
	}
	m.removeStale()
	m.log.Info("device plugin manager started", "dir", dir)

	defer m.shutdown()
	m.apply(ctx)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-m.wake:
			m.apply(ctx)
		case name := <-m.reserve:
			if r := m.served[name]; r != nil && !exists(r.path) {
				m.restart(ctx, r, "socket missing after failed registration")
			}
		case ev := <-w.Events:
			m.handleEvent(ctx, ev)
		case err := <-w.Errors:
			m.log.Error("watching device plugin dir", "dir", dir, "err", err)
			if errors.Is(err, fsnotify.ErrEventOverflow) {
				// An event may be lost, maybe a kubelet restart: serving
				// and registering again is harmless, missing it is not.
				// kubelet.sock's own events may be among those lost.
				m.kubeletGone = !exists(m.kubeletPath)
				for _, name := range sortedKeys(m.served) {
					if r := m.served[name]; !r.yielded {
						m.restart(ctx, r, "watch overflow")
					}
				}
			}
		}
	}
}

// removeStale deletes sockets of ours left by an earlier run: a listen on
// an existing path fails, and the kubelet would keep dialing a dead one.
func (m *Manager) removeStale() {
	entries, err := os.ReadDir(m.opts.Dir)
	if err != nil {
		m.log.Warn("listing device plugin dir", "dir", m.opts.Dir, "err", err)
		return
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), socketPrefix) || e.Type()&fs.ModeSocket == 0 {
			continue
		}
		p := filepath.Join(m.opts.Dir, e.Name())
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			m.log.Warn("removing stale socket", "path", p, "err", err)
			continue
		}
		m.log.Info("removed stale socket", "path", p)
	}
}

func (m *Manager) handleEvent(ctx context.Context, ev fsnotify.Event) {
	base := filepath.Base(ev.Name)
	gone := ev.Has(fsnotify.Remove) || ev.Has(fsnotify.Rename)
	switch {
	case base == kubeletSocket && ev.Has(fsnotify.Create):
		// The kubelet removed every socket before creating its own, ours
		// included: serve again, then register.
		m.kubeletGone = false
		m.log.Info("kubelet socket created: serving and registering again", "path", ev.Name)
		for _, name := range sortedKeys(m.served) {
			if r := m.served[name]; r.yielded {
				// The new kubelet has no stream of ours to keep.
				m.remove(r)
				continue
			}
			m.restart(ctx, m.served[name], reasonKubeletRestart)
		}
	case base == kubeletSocket && gone:
		m.kubeletGone = true
		m.log.Warn("kubelet socket removed: waiting for the kubelet", "path", ev.Name)
		for _, r := range m.served {
			m.stopRegistration(r)
			r.restarted("kubelet.sock removed; waiting for the kubelet")
		}
	case gone && m.kubeletGone:
		// A starting kubelet deletes every socket in the directory, then
		// creates kubelet.sock, whose event serves everything again: doing
		// it here too would serve and register twice.
	case gone:
		for _, r := range m.served {
			// Stopping our own server unlinks the path too; the socket
			// re-created since then is not lost, so look before acting.
			// A resource whose serve failed (srv nil) is served again too:
			// the socket may have been deleted between our listen and
			// chmod, and this removal is the only event that follows.
			if r.socket == base && !exists(r.path) && r.yielded {
				m.remove(r) // not ours to serve while the other plugin has it
				continue
			}
			if r.socket == base && !exists(r.path) {
				m.log.Warn("socket removed: serving again", "path", r.path, "wasServing", r.srv != nil)
				m.restart(ctx, r, "socket removed")
			}
		}
	}
}

const reasonKubeletRestart = "kubelet restarted"

// apply diffs the latest catalog against what is served.
func (m *Manager) apply(ctx context.Context) {
	m.mu.Lock()
	cat := m.cat
	m.mu.Unlock()
	var want map[string]*catalog.Resource
	if cat != nil {
		want = cat.Resources
	}
	var foreign map[string]string
	for _, name := range sortedKeys(m.served) {
		if want[name] != nil {
			continue
		}
		if foreign == nil {
			foreign = ForeignSockets(m.opts.Dir)
		}
		if r := m.served[name]; foreign[name] != "" && (r.yielded || r.srv != nil && r.isRegistered()) {
			m.yield(r, foreign[name])
			continue
		}
		m.remove(m.served[name])
	}
	m.mu.Lock()
	clear(m.rejected)
	m.mu.Unlock()
	for _, name := range cat.Names() {
		res := want[name]
		if res == nil {
			continue
		}
		if res.Name != name {
			// The map key is what the kubelet knows; errors must name it.
			c := *res
			c.Name = name
			res = &c
		}
		if r, ok := m.served[name]; ok {
			if r.yielded {
				r.update(res)
				r.yielded = false
				m.restart(ctx, r, "the other plugin is gone")
				continue
			}
			if r.update(res) {
				d, h := countDevices(res)
				r.log.Info("devices changed", "devices", d, "healthy", h)
			}
			continue
		}
		m.add(ctx, name, res)
	}
}

func (m *Manager) add(ctx context.Context, name string, res *catalog.Resource) {
	reject := func(why string) {
		m.log.Error("not serving resource", "resource", name, "err", why)
		m.mu.Lock()
		m.rejected[name] = why
		m.mu.Unlock()
	}
	if err := checkResourceName(name); err != nil {
		reject(err.Error())
		return
	}
	socket := m.opts.SocketName(name)
	taken := socket == kubeletSocket || socket == "" || strings.ContainsRune(socket, '/')
	for _, o := range m.served {
		taken = taken || o.socket == socket
	}
	if taken {
		reject(fmt.Sprintf("resource %s: socket name %q is unusable or taken", name, socket))
		return
	}
	r := newResource(name, socket, filepath.Join(m.opts.Dir, socket), res, m.log, m.opts.Now)
	r.onAllocate = m.opts.OnAllocate
	r.admit = m.opts.Admit
	m.mu.Lock()
	m.served[name] = r
	m.mu.Unlock()
	m.restart(ctx, r, "new resource")
}

// yield leaves resource r to the other device plugin that registered it
// after us (its socket: other), without ending our ListAndWatch stream. The
// kubelet keeps one plugin per resource, the latest to register, but still
// reads the streams of those it replaced, and when one of them ends it
// drops whichever plugin is registered then (kubelet 1.36:
// devicemanager/plugin/v1beta1 runClient): stopping our server would take
// the resource from the other plugin too, and the node would offer none.
// So the server stays and the stream is held open but silent (the catalog
// stops reaching it), leaving the kubelet the other plugin's devices. The
// stream ends when the other plugin has gone (apply serves the resource
// again), when the kubelet restarts, or when gpu-agent stops: in that last
// case the kubelet drops the other plugin as well, and it must register
// again (restart it).
func (m *Manager) yield(r *resource, other string) {
	if r.yielded {
		return
	}
	r.yielded = true
	m.stopRegistration(r)
	r.log.Warn("another device plugin registered this resource after us: it is left to that plugin; our stream to the kubelet stays open and silent, as ending it would make the kubelet drop that plugin too", "other", other)
}

func (m *Manager) remove(r *resource) {
	m.stopRegistration(r)
	m.stopServer(r)
	if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		r.log.Warn("removing socket", "path", r.path, "err", err)
	}
	m.mu.Lock()
	delete(m.served, r.name)
	m.mu.Unlock()
	r.log.Info("resource removed")
}

// restart (re)serves r and registers it. The old server is stopped before
// listening again: Go unix listeners unlink their path on Close, so stopping
// it afterwards would delete the new socket.
func (m *Manager) restart(ctx context.Context, r *resource, why string) {
	m.stopRegistration(r)
	m.stopServer(r)
	gen := r.restarted("")
	if err := m.serve(r); err != nil {
		r.setError(gen, err.Error())
		r.log.Error("serving failed", "err", err)
		return
	}
	regCtx, cancel := context.WithCancel(ctx)
	r.cancelReg = cancel
	m.wg.Go(func() { m.register(regCtx, r, gen, why) })
}

// streamWorkers is how many goroutines of a resource's gRPC server take
// its calls in turn. Without them gRPC starts a goroutine for every call,
// whose stack grows anew each time: a tenth of an Allocate's CPU in the
// agent (issue 29). The kubelet keeps one of them in ListAndWatch and makes
// its other calls one at a time; a call that finds every worker busy gets a
// goroutine of its own, as without workers. grpc-go marks the option
// experimental: a release that drops it breaks the build here, not calls.
const streamWorkers = 4

func (m *Manager) serve(r *resource) error {
	if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("resource %s: remove old socket %s: %w", r.name, r.path, err)
	}
	lis, err := net.Listen("unix", r.path)
	if err != nil {
		return fmt.Errorf("resource %s: listen on %s: %w", r.name, r.path, err)
	}
	// The kubelet runs as root; nobody else has business on this socket.
	if err := os.Chmod(r.path, 0o600); err != nil {
		lis.Close()
		return fmt.Errorf("resource %s: chmod %s: %w", r.name, r.path, err)
	}
	srv := grpc.NewServer(grpc.NumStreamWorkers(streamWorkers))
	done := make(chan struct{})
	pluginapi.RegisterDevicePluginServer(srv, &endpoint{r: r, done: done})
	r.srv, r.done = srv, done
	m.wg.Go(func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			r.log.Error("gRPC server failed", "socket", r.path, "err", err)
		}
	})
	r.log.Info("server started", "socket", r.path)
	return nil
}

func (m *Manager) stopServer(r *resource) {
	if r.srv == nil {
		return
	}
	close(r.done)
	r.srv.Stop()
	r.srv, r.done = nil, nil
	r.log.Info("server stopped", "socket", r.path)
}

func (m *Manager) stopRegistration(r *resource) {
	if r.cancelReg != nil {
		r.cancelReg()
		r.cancelReg = nil
	}
}

// register registers r with the kubelet, retrying with capped exponential
// backoff. Without a kubelet.sock it gives up quietly: the socket's Create
// event starts a new attempt.
func (m *Manager) register(ctx context.Context, r *resource, gen uint64, why string) {
	backoff := m.opts.RetryBackoff
	for attempt := 1; ; attempt++ {
		if !exists(m.kubeletPath) {
			r.setError(gen, "waiting for the kubelet: "+m.kubeletPath+" does not exist")
			r.log.Info("waiting for the kubelet before registering", "kubelet", m.kubeletPath)
			return
		}
		err := m.registerOnce(ctx, r)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			if r.setRegistered(gen, m.opts.Now()) {
				msg := "registered with the kubelet"
				if why == reasonKubeletRestart {
					msg = "re-registered after kubelet restart"
				}
				r.log.Info(msg, "endpoint", r.socket, "attempt", attempt, "after", why)
			}
			return
		}
		r.setError(gen, err.Error())
		r.log.Warn("registration failed", "attempt", attempt, "retryIn", backoff, "err", err)
		if !exists(r.path) {
			// The kubelet could not dial us because our socket is gone;
			// the Run goroutine serves again and starts a new attempt.
			select {
			case m.reserve <- r.name:
			case <-ctx.Done():
				return
			}
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, max(maxBackoff, m.opts.RetryBackoff))
	}
}

func (m *Manager) registerOnce(ctx context.Context, r *resource) error {
	conn, err := grpc.NewClient("unix://"+m.kubeletPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("resource %s: dial kubelet %s: %w", r.name, m.kubeletPath, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, registerTimeout)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     r.socket,
		ResourceName: r.name,
		Options:      pluginOptions(),
	})
	if err != nil {
		return fmt.Errorf("resource %s: register with kubelet %s: %w", r.name, m.kubeletPath, err)
	}
	return nil
}

// shutdown stops every server and removes every socket; Run's goroutines
// have ended when it returns.
func (m *Manager) shutdown() {
	for _, name := range sortedKeys(m.served) {
		m.remove(m.served[name])
	}
	m.wg.Wait()
	m.log.Info("device plugin manager stopped")
}

var (
	reDNSSubdomain  = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	reQualifiedName = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
)

// checkResourceName applies the kubelet's rule for the name of a device
// plugin's resource, an extended resource name: <domain>/<name>, the domain
// a DNS subdomain outside kubernetes.io, the name a qualified name of at
// most 63 characters. The kubelet refuses any other name at registration;
// refusing it here says why in Status instead of retrying forever.
func checkResourceName(name string) error {
	domain, rest, ok := strings.Cut(name, "/")
	switch {
	case name == "":
		return errors.New("empty resource name")
	case !ok:
		return fmt.Errorf("resource name %q: must be <domain>/<name>", name)
	case len(domain) > 253 || !reDNSSubdomain.MatchString(domain):
		return fmt.Errorf("resource name %q: domain %q is not a DNS subdomain", name, domain)
	case domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") || strings.HasPrefix(name, "requests."):
		return fmt.Errorf("resource name %q: reserved by Kubernetes", name)
	case len(rest) > 63 || !reQualifiedName.MatchString(rest):
		return fmt.Errorf("resource name %q: %q must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", name, rest)
	}
	return nil
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func sortedKeys(m map[string]*resource) []string {
	return slices.Sorted(maps.Keys(m))
}
