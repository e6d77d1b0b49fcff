package plugin

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/ledger"
)

// The benchmarks of this file set the agent's Allocate against a bare
// device plugin's on the same gRPC server shape (issue 29: Allocate within
// 1.1× of a bare plugin): what differs between the two is the agent's own
// work and the garbage it leaves, which allocs/op counts.
//
//	go test -run '^$' -bench 'AllocateOverhead|AllocateHandler' -benchmem ./plugin

// overheadGPUs is the node of test/bench's allocate-overhead: 8 whole GPUs,
// offered as `gpu-agent run` offers them by default (the envvar strategy,
// no device nodes, as PassDeviceSpecs is off).
const overheadGPUs = 8

func overheadCatalog() (*catalog.Catalog, []gpu.GPU) {
	res := &catalog.Resource{Name: resGPU}
	var inv []gpu.GPU
	for i := range overheadGPUs {
		u := fmt.Sprintf("GPU-%08x-1111-2222-3333-%012x", i, i)
		res.Devices = append(res.Devices, catalog.Device{ID: u, Healthy: true, NUMANode: i / 4, GPU: i,
			Spec: catalog.AllocateSpec{VisibleID: u}})
		inv = append(inv, gpu.GPU{UUID: u, Index: i})
	}
	return &catalog.Catalog{Resources: map[string]*catalog.Resource{resGPU: res}}, inv
}

// overheadOptions are the agent's plugin options as `gpu-agent run` sets
// them without DRA: Admit through a ledger whose allocation log is in a
// fresh directory, and OnAllocate kicking a one-slot channel as the
// pod-resources client's Invalidate does.
func overheadOptions(b *testing.B, inv []gpu.GPU) Options {
	b.Helper()
	l, err := ledger.New(ledger.Options{StateDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(l.Close)
	l.SetInventory(inv)
	kick := make(chan struct{}, 1)
	return Options{
		Logger: slog.New(slog.NewJSONHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Admit: func(resource string, devs []Handout) error {
			var buf [8]ledger.Handout
			hs := buf[:0]
			for _, d := range devs {
				hs = append(hs, ledger.Handout{UUID: d.UUID, Replica: d.Replica})
			}
			return l.Admit(resource, hs)
		},
		OnAllocate: func(string, []string) {
			select {
			case kick <- struct{}{}:
			default:
			}
		},
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// bareServer is test/bench's bare plugin: Allocate answers the requested
// IDs as NVIDIA_VISIBLE_DEVICES and four device nodes, and does nothing else.
type bareServer struct {
	pluginapi.UnimplementedDevicePluginServer
}

var bareNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0"}

func (bareServer) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.GetContainerRequests() {
		cr := &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{visibleDevicesEnv: strings.Join(c.GetDevicesIds(), ",")},
		}
		for _, n := range bareNodes {
			cr.Devices = append(cr.Devices, &pluginapi.DeviceSpec{ContainerPath: n, HostPath: n, Permissions: "rw"})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cr)
	}
	return resp, nil
}

// overheadRequests are one Allocate of one GPU per GPU, as the bench cycles
// over them.
func overheadRequests(res *catalog.Resource) []*pluginapi.AllocateRequest {
	var reqs []*pluginapi.AllocateRequest
	for _, d := range res.Devices {
		reqs = append(reqs, allocReq([]string{d.ID}))
	}
	return reqs
}

// BenchmarkAllocateHandler is one Allocate of one GPU without gRPC: the
// agent's endpoint (the answer, the ledger's check and its log's write, the
// pod-resources kick) against the bare plugin's handler.
func BenchmarkAllocateHandler(b *testing.B) {
	cat, inv := overheadCatalog()
	res := cat.Resources[resGPU]
	reqs := overheadRequests(res)
	ctx := context.Background()
	for _, bc := range []struct {
		name string
		srv  func(b *testing.B) pluginapi.DevicePluginServer
	}{
		{"bare", func(*testing.B) pluginapi.DevicePluginServer { return bareServer{} }},
		{"agent", func(b *testing.B) pluginapi.DevicePluginServer {
			opts := overheadOptions(b, inv)
			r := newResource(resGPU, "gpu.sock", "", res, opts.Logger, time.Now)
			r.admit, r.onAllocate = opts.Admit, opts.OnAllocate
			return &endpoint{r: r}
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			srv := bc.srv(b)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, err := srv.Allocate(ctx, reqs[i%len(reqs)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkAllocateOverhead is one Allocate of one GPU over a unix socket,
// client and server in this process: the agent's Manager against the bare
// handler on a gRPC server of the same options. Both columns include the
// client's share, which is the same on both sides.
func BenchmarkAllocateOverhead(b *testing.B) {
	cat, inv := overheadCatalog()
	reqs := overheadRequests(cat.Resources[resGPU])
	ctx := context.Background()
	for _, bc := range []struct {
		name  string
		serve func(b *testing.B) string // the socket
	}{
		{"bare", func(b *testing.B) string {
			sock := filepath.Join(shortDir(b), "bare.sock")
			lis, err := net.Listen("unix", sock)
			if err != nil {
				b.Fatal(err)
			}
			srv := grpc.NewServer()
			pluginapi.RegisterDevicePluginServer(srv, bareServer{})
			go func() { _ = srv.Serve(lis) }()
			b.Cleanup(srv.Stop)
			return sock
		}},
		{"agent", func(b *testing.B) string {
			opts := overheadOptions(b, inv)
			opts.Dir = shortDir(b)
			startKubelet(b, opts.Dir)
			startManagerWith(b, cat, opts)
			return filepath.Join(opts.Dir, DefaultSocketName(resGPU))
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			c := dialPlugin(b, bc.serve(b))
			if _, err := c.Allocate(ctx, reqs[0]); err != nil { // connect outside the measurement
				b.Fatal(err)
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if _, err := c.Allocate(ctx, reqs[i%len(reqs)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}
