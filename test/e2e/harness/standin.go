package harness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// StandInPlugin is a second device plugin on the Env's kubelet: a bare one that offers a fixed list of devices
// under one resource name, from a socket in the kubelet's device plugin directory, as NVIDIA's device plugin
// does when a node still runs it beside gpu-agent. It runs in the test process; Stop ends it as that plugin
// ends on SIGTERM (its server stopped, its socket removed).
type StandInPlugin struct {
	// Path is the plugin's socket.
	Path string
	srv  *grpc.Server
	mu   sync.Mutex
	// allocated counts the Allocate calls the kubelet made.
	allocated int
	stopOnce  sync.Once
	done      chan struct{}
}

// StartStandInPlugin serves ids as resource's devices from socket (a file name in DevicePluginDir; NVIDIA's
// plugin names its sockets nvidia-<name>.sock) and registers with the kubelet. It returns once the kubelet
// accepted the registration; the caller then waits with WaitAllocatable for the devices to reach the kubelet.
func StartStandInPlugin(ctx context.Context, socket, resource string, ids []string) (*StandInPlugin, error) {
	p := &StandInPlugin{Path: filepath.Join(DevicePluginDir, socket), done: make(chan struct{})}
	if err := os.Remove(p.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("stand-in plugin %s: %w", p.Path, err)
	}
	lis, err := net.Listen("unix", p.Path)
	if err != nil {
		return nil, fmt.Errorf("stand-in plugin %s: %w", p.Path, err)
	}
	p.srv = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.srv, &standInServer{p: p, ids: ids})
	go func() { _ = p.srv.Serve(lis) }()

	conn, err := grpc.NewClient("unix://"+filepath.Join(DevicePluginDir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		p.Stop()
		return nil, fmt.Errorf("stand-in plugin %s: dial the kubelet: %w", resource, err)
	}
	defer conn.Close()
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(rctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: socket, ResourceName: resource,
	})
	if err != nil {
		p.Stop()
		return nil, fmt.Errorf("stand-in plugin %s: register: %w", resource, err)
	}
	return p, nil
}

// Stop ends ListAndWatch, stops the server and removes the socket (a Go unix listener unlinks its path on
// Close).
func (p *StandInPlugin) Stop() {
	p.stopOnce.Do(func() {
		close(p.done)
		p.srv.Stop()
	})
}

// Allocated is how many Allocate calls the kubelet made to the plugin.
func (p *StandInPlugin) Allocated() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.allocated
}

type standInServer struct {
	pluginapi.UnimplementedDevicePluginServer
	p   *StandInPlugin
	ids []string
}

func (s *standInServer) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the devices once, all healthy, and holds the stream until Stop: the kubelet takes a
// stream that ends as the plugin gone.
func (s *standInServer) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	resp := &pluginapi.ListAndWatchResponse{}
	for _, id := range s.ids {
		resp.Devices = append(resp.Devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	if err := stream.Send(resp); err != nil {
		return err
	}
	select {
	case <-s.p.done:
	case <-stream.Context().Done():
	}
	return nil
}

func (s *standInServer) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	s.p.mu.Lock()
	s.p.allocated++
	s.p.mu.Unlock()
	resp := &pluginapi.AllocateResponse{}
	for range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{})
	}
	return resp, nil
}

func (s *standInServer) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (s *standInServer) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
