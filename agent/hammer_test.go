package agent

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/plugin"
	"github.com/gpu-agent/gpu-agent/podresources"
)

var hammerFlips = flag.Int("hammer.flips", 20, "layout changes TestAllocateHammer makes while it allocates")

// registrar is the kubelet's registration service: it accepts every plugin.
type registrar struct {
	pluginapi.UnimplementedRegistrationServer
}

func (registrar) Register(context.Context, *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	return &pluginapi.Empty{}, nil
}

// kubeletModel is the containers the hammer started: the devices each
// holds, listed by pod-resources from the moment Allocate answered, until
// the container ends.
type kubeletModel struct {
	mu   sync.Mutex
	held map[string]string // device UUID → resource
	// since/ended: when (in destroy-check steps) each hold began and ended.
	since, ended map[string]int
	epoch        int
}

func (k *kubeletModel) Refresh(context.Context) (*podresources.Attribution, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var ctrs []*podresourcesv1.ContainerResources
	for _, uuid := range slices.Sorted(maps.Keys(k.held)) {
		ctrs = append(ctrs, &podresourcesv1.ContainerResources{Name: "c-" + uuid,
			Devices: []*podresourcesv1.ContainerDevices{{ResourceName: k.held[uuid], DeviceIds: []string{uuid}}}})
	}
	return podresources.NewAttribution([]*podresourcesv1.PodResources{{Name: "hammer", Namespace: "ml", Containers: ctrs}}, nil), nil
}

// checkingApplier runs the real applier and, around each GPU's plan, reads
// the GPU: a MIG device gone after Apply that a container held when Apply
// began, or was given during it, was destroyed under its container.
type checkingApplier struct {
	next *mig.Applier
	node *sim.Node
	k    *kubeletModel
	// Under k.mu.
	violations []string
	destroyed  int
}

// turns is a Publisher that says when the loop published.
type turns struct {
	Publisher
	ch chan struct{}
}

func (p turns) Update(c *catalog.Catalog) {
	p.Publisher.Update(c)
	select {
	case p.ch <- struct{}{}:
	default:
	}
}

func (c *checkingApplier) Apply(ctx context.Context, p mig.Plan, g mig.Guard) (mig.State, error) {
	before := c.devices(p.GPU)
	c.k.mu.Lock()
	c.k.epoch++
	start := c.k.epoch
	heldAtStart := maps.Clone(c.k.held)
	c.k.mu.Unlock()
	st, err := c.next.Apply(ctx, p, g)
	after := c.devices(p.GPU)
	c.k.mu.Lock()
	defer c.k.mu.Unlock()
	c.k.epoch++
	for _, uuid := range before {
		if slices.Contains(after, uuid) {
			continue
		}
		c.destroyed++
		if _, held := heldAtStart[uuid]; held {
			c.violations = append(c.violations, fmt.Sprintf("GPU %d: %s destroyed while its container ran (held from step %d)", p.GPU, uuid, c.k.since[uuid]))
		} else if s, ok := c.k.since[uuid]; ok && s >= start {
			c.violations = append(c.violations, fmt.Sprintf("GPU %d: %s handed out while the plan ran, then destroyed", p.GPU, uuid))
		}
	}
	return st, err
}

func (c *checkingApplier) devices(idx int) []string {
	inv, err := gpu.New(c.node, gpu.Options{})
	if err != nil || idx >= len(inv.GPUs) {
		return nil
	}
	var out []string
	for _, m := range inv.GPUs[idx].Instances {
		out = append(out, m.UUID)
	}
	return out
}

// safeClock is a clock the hammer advances from its own goroutine.
type safeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *safeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *safeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// The loop, the plugin's gRPC servers and a kubelet that allocates as fast
// as it can, all for real and at once, while the layout of eight GPUs flips
// between 7× 1g.5gb and 2× 3g.20gb: whatever the interleaving, no device
// Allocate handed out is destroyed while its container runs, and none is
// handed out and destroyed by one plan. Containers end at random, so the
// layouts do get applied around them. -hammer.flips sets how many flips.
func TestAllocateHammer(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the loop and the plugin servers for real")
	}
	dir, err := os.MkdirTemp("", "hammer")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	node, err := sim.New("dgx-a100", sim.WithMIGEnabled())
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	t.Cleanup(func() { node.Shutdown() })
	pluginDir := filepath.Join(dir, "dp")
	os.Mkdir(pluginDir, 0o755)
	ln, err := net.Listen("unix", filepath.Join(pluginDir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	reg := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(reg, registrar{})
	go reg.Serve(ln)
	t.Cleanup(reg.Stop)

	clock := &safeClock{now: time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)}
	k := &kubeletModel{held: map[string]string{}, since: map[string]int{}, ended: map[string]int{}}
	held, err := ledger.New(ledger.Options{StateDir: filepath.Join(dir, "state"), Now: clock.Now})
	if err != nil {
		os.MkdirAll(filepath.Join(dir, "state"), 0o755)
		if held, err = ledger.New(ledger.Options{StateDir: filepath.Join(dir, "state"), Now: clock.Now}); err != nil {
			t.Fatal(err)
		}
	}
	inbox := NewInbox()
	mgr, err := plugin.NewManager(plugin.Options{Dir: pluginDir, RetryBackoff: 10 * time.Millisecond,
		Admit:      Admit(held),
		OnAllocate: func(res string, ids []string) { inbox.Post(Allocated{Resource: res, IDs: ids}) }})
	if err != nil {
		t.Fatal(err)
	}
	ap := &checkingApplier{next: mig.NewApplier(node, filepath.Join(dir, "state"), nil), node: node, k: k}
	pub := turns{Publisher: mgr, ch: make(chan struct{}, 1)}
	a := New(Options{Observer: mig.NewObserver(node, gpu.Options{}), NodeName: "n", WaitForConfig: true,
		Inbox: inbox, Publisher: pub, Holdings: k, MIG: ap, Ledger: held, StateDir: filepath.Join(dir, "state"),
		Now: clock.Now, ResyncInterval: time.Hour, Logger: slog.New(slog.DiscardHandler)})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Add(2)
	go func() { defer wg.Done(); mgr.Run(ctx) }()
	go func() { defer wg.Done(); a.Run(ctx) }()

	layouts := []string{`{"1g.5gb": 7}`, `{"3g.20gb": 2}`}
	settled := func(want string) bool {
		st := a.Status()
		if len(st.MIG) != 8 {
			return false
		}
		for _, m := range st.MIG {
			if m.Want != want || m.Phase != mig.PhaseApplied {
				return false
			}
		}
		return true
	}

	// The kubelet: allocate a device the catalog offers healthy that no
	// container of its own holds, over the plugin's socket, as fast as it
	// can; end a container now and then.
	// A few containers at a time, so that every GPU is free now and then
	// and each layout gets applied everywhere.
	const maxHeld = 4
	stop, stopped := make(chan struct{}), make(chan struct{})
	var accepted, refused int
	why := map[string]int{}
	go func() {
		defer close(stopped)
		rng := rand.New(rand.NewPCG(1, 2))
		conns := map[string]pluginapi.DevicePluginClient{}
		for {
			select {
			case <-stop:
				return
			default:
			}
			cat := a.Catalog()
			if cat == nil {
				<-pub.ch
				continue
			}
			var res string
			var free []string
			for _, name := range cat.Names() {
				k.mu.Lock()
				for _, d := range cat.Resources[name].Devices {
					if _, held := k.held[d.ID]; d.Healthy && !held {
						res = name
						free = append(free, d.ID)
					}
				}
				k.mu.Unlock()
				if len(free) > 0 {
					break
				}
			}
			k.mu.Lock()
			ended := len(k.held) > 0 && (len(k.held) >= maxHeld || rng.IntN(2) == 0)
			if ended {
				uuids := slices.Sorted(maps.Keys(k.held))
				gone := uuids[rng.IntN(len(uuids))]
				delete(k.held, gone)
				k.ended[gone] = k.epoch
			}
			k.mu.Unlock()
			if ended {
				// The background refresh of pod-resources tells the loop.
				att, _ := k.Refresh(ctx)
				inbox.Post(HoldingsChanged{Attribution: att, Answered: clock.Now()})
			}
			k.mu.Lock()
			full := len(k.held) >= maxHeld
			k.mu.Unlock()
			if len(free) == 0 || full {
				<-pub.ch // nothing to take until the loop publishes again
				continue
			}
			c, ok := conns[res]
			if !ok {
				conn, err := grpc.NewClient("unix://"+filepath.Join(pluginDir, plugin.DefaultSocketName(res)), grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					continue
				}
				defer conn.Close()
				c = pluginapi.NewDevicePluginClient(conn)
				conns[res] = c
			}
			id := free[rng.IntN(len(free))]
			// As the kubelet's device manager, which holds its lock while
			// it allocates and answers pod-resources under it too: no
			// answer and no MIG plan falls between Allocate's answer and
			// the kubelet's record of it. Without it, a loaded machine
			// could run a plan (and an answer, 5 fake seconds later, not
			// listing the device) in that gap, and the test blamed the
			// agent for the kubelet's missing record.
			k.mu.Lock()
			callCtx, done := context.WithTimeout(ctx, time.Second)
			_, err := c.Allocate(callCtx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{id}}}})
			done()
			if err == nil {
				k.held[id] = res
				k.since[id] = k.epoch
			}
			k.mu.Unlock()
			if err != nil {
				refused++
				why[status.Code(err).String()]++
				if status.Code(err) == codes.Unavailable {
					delete(conns, res) // the resource's server went, and may be back
				}
				continue
			}
			accepted++
		}
	}()

	for i := range *hammerFlips {
		layout := layouts[i%2]
		inbox.Post(ConfigChanged{Update: config.Update{Data: []byte(mixedLayout(layout))}})
		want := "2x 3g.20gb"
		if i%2 == 0 {
			want = "7x 1g.5gb"
		}
		deadline := time.Now().Add(30 * time.Second)
		for !settled(want) {
			if time.Now().After(deadline) {
				t.Fatalf("flip %d to %s did not settle: %+v", i, layout, a.Status().MIG)
			}
			// Time passes (allocations settle after 5 s) and the loop
			// resyncs: a pending GPU is repartitioned once the containers
			// on it ended and the kubelet said so.
			clock.Advance(time.Second)
			inbox.Post(Tick{})
			select {
			case <-pub.ch:
			case <-time.After(100 * time.Millisecond): // only to resync again
			}
		}
	}
	close(stop)
	select {
	case pub.ch <- struct{}{}: // a kubelet waiting for the loop stops waiting
	default:
	}
	<-stopped
	k.mu.Lock()
	defer k.mu.Unlock()
	t.Logf("%d flips: %d allocations accepted, %d refused %v, %d MIG devices destroyed", *hammerFlips, accepted, refused, why, ap.destroyed)
	for _, v := range ap.violations {
		t.Error(v)
	}
	if accepted == 0 || ap.destroyed == 0 {
		t.Errorf("the hammer did not hammer: %d allocations, %d destroys", accepted, ap.destroyed)
	}
}
