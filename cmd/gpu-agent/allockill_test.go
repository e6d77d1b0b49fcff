package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/plugin"
)

var (
	builtOnce sync.Once
	builtBin  string
	builtErr  error
	builtOut  []byte
)

// agentBinary builds the gpu-agent binary once for the tests that run it.
func agentBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary")
	}
	builtOnce.Do(func() {
		dir, err := os.MkdirTemp("", "gpu-agent-bin")
		if err != nil {
			builtErr = err
			return
		}
		builtBin = filepath.Join(dir, "gpu-agent")
		// Linked as the Makefile links it, so the version reaches
		// `version`, /status and gpu_agent_build_info (TestVersion).
		build := exec.Command("go", "build", "-ldflags", "-X main.version="+testVersion+" -X main.commit="+testCommit, "-o", builtBin, ".")
		build.Env = append(os.Environ(), "CGO_CFLAGS=-Wno-deprecated-declarations")
		builtOut, builtErr = build.CombinedOutput()
	})
	if builtErr != nil {
		t.Fatalf("build: %v\n%s", builtErr, builtOut)
	}
	return builtBin
}

// podResources is the kubelet's pod-resources List: from a given time it
// lists one container holding the devices it is given, before then none
// (the kubelet lists a container once it admits its pod).
type podResources struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	mu    sync.Mutex
	from  time.Time
	res   string
	ids   []string
	calls int
}

func (p *podResources) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.ids == nil || time.Now().Before(p.from) {
		return &podresourcesv1.ListPodResourcesResponse{}, nil
	}
	return &podresourcesv1.ListPodResourcesResponse{PodResources: []*podresourcesv1.PodResources{{
		Name: "trainer", Namespace: "ml", Containers: []*podresourcesv1.ContainerResources{{
			Name: "main", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: p.res, DeviceIds: p.ids}}}}}}}, nil
}

func (p *podResources) listFrom(at time.Time, res string, ids ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.from, p.res, p.ids = at, res, ids
}

// Issue 23, defect 2: Allocate answered before its allocation was durable.
// Killed right after the answer, the agent lost it, and the restarted agent
// destroyed the device under its container, because pod-resources did not
// list it yet. The allocation log has it before the answer leaves, so the
// restarted agent keeps the device until the kubelet lists its container,
// and after.
func TestAllocationSurvivesSIGKILL(t *testing.T) {
	bin := agentBinary(t)
	began := time.Now()
	dir, err := os.MkdirTemp("", "ga")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pluginDir := filepath.Join(dir, "dp")
	os.Mkdir(pluginDir, 0o755)
	startFakeKubelet(t, pluginDir)
	pr := &podResources{}
	prSock := filepath.Join(dir, "pr.sock")
	ln, err := net.Listen("unix", prSock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, pr)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)

	cfg := filepath.Join(dir, "config.yaml")
	const res = "nvidia.com/mig-1g.10gb"
	mixed := "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n"
	if err := os.WriteFile(cfg, []byte(mixed), 0o644); err != nil {
		t.Fatal(err)
	}
	start := func() (addr string, kill func()) {
		l, _ := net.Listen("tcp", "127.0.0.1:0")
		addr = l.Addr().String()
		l.Close()
		cmd := exec.Command(bin, "run", "--backend", "sim:dgx-h100-mig,state="+filepath.Join(dir, "sim.json"),
			"--device-plugin-dir", pluginDir, "--pod-resources-socket", prSock, "--config", cfg,
			"--listen", addr, "--state-dir", filepath.Join(dir, "state"), "--mps-root", filepath.Join(dir, "mps"), "--node-name", "n1",
			"--resync", "1s")
		var logs bytes.Buffer
		cmd.Stderr = &logs
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
			if t.Failed() {
				t.Logf("agent log:\n%s", logs.String())
			}
		})
		return addr, func() { cmd.Process.Kill(); cmd.Wait() }
	}

	addr, kill := start()
	waitStatus(t, addr, "serving 56 MIG devices", func(st *agent.Status) bool {
		for _, r := range st.Resource {
			if r.Name == res && len(r.Devices) == 56 {
				return true
			}
		}
		return false
	})
	conn, err := grpc.NewClient("unix://"+filepath.Join(pluginDir, plugin.DefaultSocketName(res)), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := pluginapi.NewDevicePluginClient(conn)
	stream, err := client.ListAndWatch(context.Background(), &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	list, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	victim := list.Devices[len(list.Devices)-1].ID
	if _, err := client.Allocate(context.Background(), &pluginapi.AllocateRequest{
		ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{victim}}}}); err != nil {
		t.Fatal(err)
	}
	t.Logf("allocated %s at +%v", victim, time.Since(began))
	kill() // at once: no time for any checkpoint after the answer
	answered := time.Now()
	// The kubelet admits the pod and lists its container 2 s after the
	// answer: until then pod-resources says nobody holds anything.
	pr.listFrom(answered.Add(2*time.Second), res, victim)

	// The restarted agent is asked for a layout that destroys every MIG
	// device of every GPU.
	layout := "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: {\"7g.80gb\": 1}\n"
	if err := os.WriteFile(cfg, []byte(layout), 0o644); err != nil {
		t.Fatal(err)
	}
	addr, _ = start()
	// Held first as an allocation the kubelet has not listed, then (an
	// answer asked 5 s after the allocation settles it) by the container
	// the kubelet lists: the victim's GPU waits throughout.
	for _, holder := range []string{"not yet listed by the kubelet", "ml/trainer (main)"} {
		st := waitStatus(t, addr, "applying the layout, with the victim's GPU held by "+holder, func(st *agent.Status) bool {
			applied, held := 0, 0
			for _, m := range st.MIG {
				switch {
				case m.Phase == "applied":
					applied++
				case strings.Contains(m.Reason, holder):
					held++
				}
			}
			// Eight applied: the victim's GPU was repartitioned too.
			return applied == 7 && held == 1 || applied == 8
		})
		t.Logf("held by %s at +%v", holder, time.Since(began))
		found := false
		for _, g := range st.GPUs {
			for _, m := range g.Instances {
				found = found || m.UUID == victim
			}
		}
		if !found {
			t.Fatalf("%s, allocated right before the kill, was destroyed after the restart", victim)
		}
	}
}
